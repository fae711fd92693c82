//! The SIMT shim, from Rust: launch any `.cu` kernel by name, with its arguments as
//! cuLaunchKernel takes them (one pointer to each argument's value). The shim executes the CUDA
//! sources on the CPU, one fiber per CUDA thread (cuda/simt/simt.h says what it models and
//! refuses; build.rs builds every kernel into it), so a kernel is held to its Rust reference on
//! a machine with no GPU. The kernels' tests call it directly; [`crate::launch::Shim`] wraps it
//! as a device for code written against [`crate::launch::Launcher`].

use std::ffi::{CStr, CString, c_char, c_int, c_void};

#[repr(C)]
struct Geometry {
    grid: [u32; 3],
    block: [u32; 3],
    reverse: c_int,
}

unsafe extern "C" {
    fn simt_launch_named(
        name: *const c_char,
        g: *const Geometry,
        params: *mut *mut c_void,
    ) -> c_int;
    fn simt_last_error() -> *const c_char;
}

/// The order the shim runs warps in: lowest first, or highest first with lanes reversed. A
/// kernel whose results differ between the two has a race.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    Forward,
    Reverse,
}

pub const SCHEDULES: [Schedule; 2] = [Schedule::Forward, Schedule::Reverse];

/// A pointer to an argument's value, as cuLaunchKernel takes it: `arg(&rows)`, and for a
/// buffer, `arg(&x.as_ptr())` (the pointer is the value).
pub fn arg<T>(value: &T) -> *mut c_void {
    value as *const T as *mut c_void
}

/// Run the kernel `name` over `grid` blocks of `block` threads.
///
/// # Safety
/// `params` must hold one pointer for each of the kernel's parameters, each to a value of that
/// parameter's type, and every buffer a kernel reaches through them must hold what it indexes.
pub unsafe fn launch(
    name: &str,
    grid: [u32; 3],
    block: [u32; 3],
    schedule: Schedule,
    params: &[*mut c_void],
) -> Result<(), String> {
    #[cfg(test)]
    if let Some(gpu) = crate::mirror::active()
        && gpu.compiles(name)
    {
        // SAFETY: as this function's (the kernels' tests on a GPU: see crate::mirror).
        return unsafe { gpu.launch(name, grid, block, params) };
    }
    let c_name = CString::new(name).map_err(|e| e.to_string())?;
    let g = Geometry {
        grid,
        block,
        reverse: c_int::from(schedule == Schedule::Reverse),
    };
    let mut params = params.to_vec();
    // SAFETY: the caller vouches for the parameters; the name and geometry are ours.
    let status = unsafe { simt_launch_named(c_name.as_ptr(), &g, params.as_mut_ptr()) };
    if status == 0 {
        return Ok(());
    }
    // SAFETY: the shim returns a NUL-terminated string that lives until its next launch on
    // this thread.
    let reason = unsafe { CStr::from_ptr(simt_last_error()) };
    Err(format!("{name}: {}", reason.to_string_lossy()))
}

/// [`launch`] over a one-dimensional grid and block.
///
/// # Safety
/// As [`launch`].
pub unsafe fn launch_1d(
    name: &str,
    grid: u32,
    block: u32,
    schedule: Schedule,
    params: &[*mut c_void],
) -> Result<(), String> {
    // SAFETY: passed on.
    unsafe { launch(name, [grid, 1, 1], [block, 1, 1], schedule, params) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What each shuffle gives every lane of a 64-thread block, lanes holding 100 + lane.
    fn shuffled(kind: c_int, lane_arg: c_int, width: c_int) -> Vec<c_int> {
        let mut out = vec![0; 64];
        let p = out.as_mut_ptr();
        let params = [arg(&p), arg(&kind), arg(&lane_arg), arg(&width)];
        // SAFETY: `out` holds one value per thread of the block.
        unsafe { launch_1d("check_shuffles", 1, 64, Schedule::Forward, &params) }.unwrap();
        out
    }

    /// CUDA's rule: a source lane outside the lane's segment of `width` gives its own value.
    fn expected(kind: c_int, lane_arg: i32, width: i32) -> Vec<c_int> {
        (0..64)
            .map(|t: i32| {
                let lane = t % 32;
                let segment = lane / width;
                let src = match kind {
                    0 => lane ^ lane_arg,
                    1 => lane + lane_arg,
                    2 => lane - lane_arg,
                    _ => segment * width + lane_arg % width,
                };
                let src = if src >= 0 && src / width == segment {
                    src
                } else {
                    lane
                };
                100 + src
            })
            .collect()
    }

    #[test]
    fn shuffles_give_cudas_lanes() {
        for kind in 0..4 {
            for (lane_arg, width) in [
                (1, 32),
                (16, 32),
                (3, 32),
                (5, 8),
                (2, 4),
                (31, 32),
                (0, 32),
            ] {
                assert_eq!(
                    shuffled(kind, lane_arg, width),
                    expected(kind, lane_arg, width),
                    "kind {kind}, arg {lane_arg}, width {width}"
                );
            }
        }
    }

    /// ldmatrix as the PTX ISA states it: lane 8·m + r gives row r of matrix m, and lane
    /// 4·r + w gets that row's values 2w, 2w + 1 (transposed: column r's in rows 2w, 2w + 1),
    /// the first in the low half, for 1, 2 and 4 matrices.
    #[test]
    fn ldmatrix_gives_each_lane_the_rows_the_isa_says() {
        // Row `lane` passes: (7·lane) % 32 of a table holding R·8 + c at row R, column c.
        let row = |lane: u32| (7 * lane) % 32;
        let value = |lane: u32, col: u32| row(lane) * 8 + col;
        for count in [1, 2, 4] {
            for trans in [0, 1] {
                let mut out = vec![0u32; 64 * 4];
                let p = out.as_mut_ptr();
                // SAFETY: four words per thread.
                unsafe {
                    launch_1d(
                        "check_ldmatrix",
                        1,
                        64,
                        Schedule::Reverse,
                        &[arg(&p), arg(&count), arg(&trans)],
                    )
                }
                .unwrap();
                for t in 0..64u32 {
                    let (r, w) = (t % 32 / 4, t % 4);
                    for m in 0..4u32 {
                        let want = if m >= count as u32 {
                            0
                        } else if trans == 1 {
                            value(8 * m + 2 * w, r) | value(8 * m + 2 * w + 1, r) << 16
                        } else {
                            value(8 * m + r, 2 * w) | value(8 * m + r, 2 * w + 1) << 16
                        };
                        let got = out[(4 * t + m) as usize];
                        assert_eq!(got, want, "x{count} trans={trans}: thread {t}, word {m}");
                    }
                }
            }
        }
    }

    /// cp.async lands a group when a wait lets it: in the forward schedule at the latest
    /// moment (the wait for it), in the reverse at once; so a group not waited for reads as
    /// what was there before in one schedule and as the copy in the other.
    #[test]
    fn cp_async_lands_at_the_wait_or_at_once() {
        let src: Vec<c_int> = (0..4 * 64).map(|i| 1000 + i).collect();
        let groups = |schedule| {
            let mut out = vec![0; 2 * 64];
            let (p, s) = (out.as_mut_ptr(), src.as_ptr());
            // SAFETY: two values a thread out, four a thread in.
            unsafe {
                launch_1d(
                    "check_cp_async_groups",
                    1,
                    64,
                    schedule,
                    &[arg(&p), arg(&s)],
                )
            }
            .unwrap();
            out
        };
        let waited: Vec<c_int> = (0..64).map(|t| 1000 + 4 * t).collect();
        let (late, early) = (groups(Schedule::Forward), groups(Schedule::Reverse));
        for t in 0..64 {
            assert_eq!(late[2 * t], waited[t], "the older group has landed");
            assert_eq!(
                late[2 * t + 1],
                0,
                "the newest is still in flight at the latest"
            );
            assert_eq!(early[2 * t], waited[t]);
            assert_eq!(
                early[2 * t + 1],
                waited[t],
                "the newest has landed at the earliest"
            );
        }
        let neighbour = |schedule, with_wait: c_int| {
            let mut out = vec![0; 64];
            let (p, s) = (out.as_mut_ptr(), src.as_ptr());
            // SAFETY: one value a thread out, four a thread in.
            unsafe {
                launch_1d(
                    "check_cp_async_neighbour",
                    1,
                    64,
                    schedule,
                    &[arg(&p), arg(&s), arg(&with_wait)],
                )
            }
            .unwrap();
            out
        };
        let want: Vec<c_int> = (0..64).map(|t| 1000 + 4 * ((t + 1) % 64)).collect();
        assert_eq!(neighbour(Schedule::Forward, 1), want);
        assert_eq!(neighbour(Schedule::Reverse, 1), want);
        assert_ne!(
            neighbour(Schedule::Forward, 0),
            neighbour(Schedule::Reverse, 0),
            "without the wait the schedules disagree"
        );
    }

    #[test]
    fn a_missing_barrier_shows_as_schedules_that_disagree() {
        let run = |schedule, with_barrier: c_int| {
            let mut out = vec![0; 96];
            let p = out.as_mut_ptr();
            // SAFETY: one value per thread.
            unsafe {
                launch_1d(
                    "check_neighbour",
                    1,
                    96,
                    schedule,
                    &[arg(&p), arg(&with_barrier)],
                )
            }
            .unwrap();
            out
        };
        let want: Vec<c_int> = (0..96).map(|t| ((t + 1) % 96) * 7 + 1).collect();
        assert_eq!(run(Schedule::Forward, 1), want);
        assert_eq!(run(Schedule::Reverse, 1), want);
        assert_ne!(
            run(Schedule::Forward, 0),
            run(Schedule::Reverse, 0),
            "without the barrier the order shows"
        );
    }

    #[test]
    fn wrong_barriers_and_unknown_kernels_are_refused_with_a_reason() {
        let refused = |name: &str, params: &[*mut c_void]| {
            // SAFETY: these kernels take at most one buffer of a value per thread.
            unsafe { launch_1d(name, 1, 64, Schedule::Forward, params) }.unwrap_err()
        };
        let divergent = refused("check_divergent_barrier", &[]);
        assert!(divergent.contains("different barriers"), "{divergent}");
        let returned = refused("check_barrier_after_return", &[]);
        assert!(returned.contains("returned"), "{returned}");
        let mut out = vec![0; 64];
        let p = out.as_mut_ptr();
        let lanes = refused("check_shuffle_after_return", &[arg(&p)]);
        assert!(
            lanes.contains("after lanes of the warp returned"),
            "{lanes}"
        );
        let mixed = refused("check_mixed_warp_ops", &[arg(&p)]);
        assert!(mixed.contains("different warp-level operations"), "{mixed}");
        let ldmatrix = refused("check_ldmatrix_mixed", &[arg(&p)]);
        assert!(
            ldmatrix.contains("different numbers of matrices or transposes"),
            "{ldmatrix}"
        );
        let misaligned = refused("check_misaligned_vector", &[arg(&p)]);
        assert!(misaligned.contains("not 16-byte aligned"), "{misaligned}");
        let unknown = refused("rms_norm_sideways", &[]);
        assert!(
            unknown.contains("no kernel named `rms_norm_sideways`"),
            "{unknown}"
        );
        // The shim still launches after a refused kernel.
        assert_eq!(shuffled(0, 1, 32), expected(0, 1, 32));
    }
}
