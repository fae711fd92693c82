//! `acc += x` and `dst = src` on a device (accumulate.cu): the GPU trainer's gradient sums and
//! its residual stream's copies. Their references are f32 addition and a copy, so the test
//! asks for the same bytes.

#[cfg(test)]
mod tests {
    use crate::launch::{Arg, Geometry, Launcher, Shim};
    use crate::testing::{Rng, Schedule};

    #[test]
    fn the_cuda_add_and_copy_give_the_bytes_of_f32_addition_and_of_a_copy() {
        let mut rng = Rng::new(5);
        for n in [1usize, 31, 1000, 4099] {
            let acc: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            let x: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            let want: Vec<f32> = acc.iter().zip(&x).map(|(a, b)| a + b).collect();
            for (grid, block) in [(1, 32), (3, 64), (64, 128)] {
                for schedule in [Schedule::Forward, Schedule::Reverse] {
                    let shim = Shim { schedule };
                    let a = shim.upload_f32(&acc).unwrap();
                    let b = shim.upload_f32(&x).unwrap();
                    let args = [Arg::Ptr(&a, 0), Arg::Ptr(&b, 0), Arg::Usize(n)];
                    // SAFETY: both buffers hold n floats.
                    let launched =
                        unsafe { shim.launch("add_f32", Geometry::linear(grid, block), &args) };
                    launched.unwrap();
                    let got = shim.read_f32(&a, 0, n).unwrap();
                    assert_eq!(got, want, "add: n {n}, grid × block ({grid}, {block})");
                    let copy = shim.alloc(n * 4).unwrap();
                    let args = [Arg::Ptr(&copy, 0), Arg::Ptr(&b, 0), Arg::Usize(n)];
                    // SAFETY: both buffers hold n floats.
                    let launched =
                        unsafe { shim.launch("copy_f32", Geometry::linear(grid, block), &args) };
                    launched.unwrap();
                    assert_eq!(shim.read_f32(&copy, 0, n).unwrap(), x, "copy: n {n}");
                }
            }
        }
    }
}
