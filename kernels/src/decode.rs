//! Cached decoding on a device (`decode.cu`): one new token per batch row against an attention
//! block's key/value cache, or a Mamba-2 block's convolution window and SSM state. The CPU
//! decodes with candle ops in ops/model (`src/decode.rs`, `src/layers.rs`' `Attention::step`,
//! `src/mamba2.rs`' `Mamba2::step`); the references below are the same arithmetic as plain
//! loops over a few steps, rows sitting some steps out as left padding and finished rows do.
//!
//! Must match: the references within 1e-5 relative to each result's largest magnitude (the
//! device's `expf` is not the host's, and the sums are in another order), the caches to the
//! byte where nothing is computed (keys, values, the window), and both SIMT schedules to the
//! byte. The whole decoder against the CPU's is tested in ops/train (`gpu::decode`).

#[cfg(test)]
mod tests {
    use crate::launch::{Arg, Launcher, Shim};
    use crate::simt::Schedule;
    use crate::testing::*;

    /// Element-wise launches: grids that loop, leave threads idle, or cover everything.
    const LAUNCHES: [(u32, u32); 4] = [(1, 32), (3, 64), (7, 128), (64, 256)];

    fn uniform(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| (rng.uniform() as f32 * 2.0 - 1.0) * scale)
            .collect()
    }

    /// Whether each row feeds a real token at a step: mostly, with some sitting out.
    fn flags(rng: &mut Rng, batch: usize) -> Vec<u32> {
        (0..batch).map(|_| (rng.uniform() < 0.7) as u32).collect()
    }

    /// RoPE's `x·cos + rotate_half(x)·sin` of one d-wide head.
    fn rotate(x: &[f32], cos: &[f32], sin: &[f32]) -> Vec<f32> {
        let half = x.len() / 2;
        (0..x.len())
            .map(|j| {
                let other = if j < half { -x[j + half] } else { x[j - half] };
                x[j] * cos[j] + other * sin[j]
            })
            .collect()
    }

    /// One step's inputs: `qkv` (B, (h + 2k)·d), RoPE's cos and sin (B, d), and each row's
    /// flag (1: a real token).
    type Step = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<u32>);

    struct Attention {
        batch: usize,
        heads: usize,
        kv_heads: usize,
        d: usize,
        max_len: usize,
        rope: bool,
    }

    /// The steps' outputs (q, then y, per step) and the final caches, from the kernels on the
    /// shim with `(append, attend)` launches.
    fn attention_on_shim(
        a: &Attention,
        steps: &[Step],
        (append, attend): ((u32, u32), (u32, u32)),
        schedule: Schedule,
    ) -> Vec<Vec<f32>> {
        let shim = Shim { schedule };
        let (b, h, k, d, max) = (a.batch, a.heads, a.kv_heads, a.d, a.max_len);
        let floats = |n: usize| shim.alloc(n * 4).unwrap();
        let (q, kc, vc) = (
            floats(b * h * d),
            floats(b * k * max * d),
            floats(b * k * max * d),
        );
        let (scores, y) = (floats(b * h * max), floats(b * h * d));
        let mut real = shim.alloc(b * max * 4).unwrap();
        let mut out = Vec::new();
        for (t, (qkv, cos, sin, flags)) in steps.iter().enumerate() {
            let qkv = shim.upload_f32(qkv).unwrap();
            let (cos, sin) = (shim.upload_f32(cos).unwrap(), shim.upload_f32(sin).unwrap());
            let column: Vec<u8> = flags.iter().flat_map(|f| f.to_ne_bytes()).collect();
            shim.write(&mut real, t * b * 4, &column).unwrap();
            let table = |t| if a.rope { Arg::Ptr(t, 0) } else { Arg::Null };
            let sizes = [b, t, max, h, k, d].map(|v| Arg::I32(v as i32));
            let args = [
                Arg::Ptr(&qkv, 0),
                table(&cos),
                table(&sin),
                Arg::Ptr(&q, 0),
                Arg::Ptr(&kc, 0),
                Arg::Ptr(&vc, 0),
            ];
            launch_on(
                &shim,
                "decode_kv_append_f32",
                append,
                &[&args[..], &sizes].concat(),
            );
            let args = [
                Arg::Ptr(&q, 0),
                Arg::Ptr(&kc, 0),
                Arg::Ptr(&vc, 0),
                Arg::Ptr(&real, 0),
                Arg::Ptr(&scores, 0),
                Arg::Ptr(&y, 0),
            ];
            launch_on(
                &shim,
                "decode_attention_f32",
                attend,
                &[&args[..], &sizes].concat(),
            );
            out.push(shim.read_f32(&q, 0, b * h * d).unwrap());
            out.push(shim.read_f32(&y, 0, b * h * d).unwrap());
        }
        let n = steps.len();
        let written = |c| {
            let all = shim.read_f32(c, 0, b * k * max * d).unwrap();
            // Only the steps fed are defined.
            all.chunks(max * d)
                .flat_map(|c| c[..n * d].to_vec())
                .collect()
        };
        out.push(written(&kc));
        out.push(written(&vc));
        out
    }

    /// The same steps as plain loops: RoPE, append, then softmax(q·k/√d)·v over the steps a
    /// row fed for real and the current one.
    fn attention_reference(a: &Attention, steps: &[Step]) -> Vec<Vec<f32>> {
        let (b, h, k, d) = (a.batch, a.heads, a.kv_heads, a.d);
        let width = (h + 2 * k) * d;
        // keys[r][kv][t], values likewise, each d wide; real[r][t].
        let mut keys = vec![vec![Vec::<Vec<f32>>::new(); k]; b];
        let mut values = keys.clone();
        let mut real = vec![Vec::new(); b];
        let mut out = Vec::new();
        for (qkv, cos, sin, flags) in steps {
            let (mut qs, mut ys) = (Vec::new(), Vec::new());
            for r in 0..b {
                let head = |i: usize| &qkv[r * width + i * d..r * width + (i + 1) * d];
                let turn = |x: &[f32]| {
                    if a.rope {
                        rotate(x, &cos[r * d..(r + 1) * d], &sin[r * d..(r + 1) * d])
                    } else {
                        x.to_vec()
                    }
                };
                for kv in 0..k {
                    keys[r][kv].push(turn(head(h + kv)));
                    values[r][kv].push(head(h + k + kv).to_vec());
                }
                real[r].push(flags[r] != 0);
                let t = real[r].len() - 1;
                for i in 0..h {
                    let q = turn(head(i));
                    let kv = i / (h / k);
                    let seen: Vec<usize> = (0..=t).filter(|&j| j == t || real[r][j]).collect();
                    let scores: Vec<f64> = seen
                        .iter()
                        .map(|&j| {
                            let dot: f64 =
                                (0..d).map(|x| q[x] as f64 * keys[r][kv][j][x] as f64).sum();
                            dot / (d as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let p: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let l: f64 = p.iter().sum();
                    ys.extend((0..d).map(|x| {
                        let acc: f64 = seen
                            .iter()
                            .zip(&p)
                            .map(|(&j, p)| p * values[r][kv][j][x] as f64)
                            .sum();
                        (acc / l) as f32
                    }));
                    qs.extend(q);
                }
            }
            out.push(qs);
            out.push(ys);
        }
        let flat =
            |c: &Vec<Vec<Vec<Vec<f32>>>>| c.iter().flatten().flatten().flatten().copied().collect();
        out.push(flat(&keys));
        out.push(flat(&values));
        out
    }

    /// decode_kv_append_f32 and decode_attention_f32, step after step with rows sitting some
    /// steps out: the plain softmax over what each row fed, with GQA and without, RoPE and
    /// none, more steps than a block has threads, in both schedules.
    #[test]
    fn attention_over_the_cache_matches_the_plain_softmax_of_what_each_row_fed() {
        let cases = [
            (1, 1, 1, 2, 1, 1),
            (3, 4, 2, 8, 6, 9),
            (2, 6, 3, 16, 40, 45),
            (2, 2, 2, 6, 3, 3),
        ];
        for (batch, heads, kv_heads, d, steps, max_len) in cases {
            for rope in [true, false] {
                let a = Attention {
                    batch,
                    heads,
                    kv_heads,
                    d,
                    max_len,
                    rope,
                };
                let mut rng = Rng::new((batch * 100 + heads * 10 + steps) as u64);
                let width = (heads + 2 * kv_heads) * d;
                let inputs: Vec<_> = (0..steps)
                    .map(|_| {
                        let qkv = uniform(&mut rng, batch * width, 2.0);
                        let angles = uniform(&mut rng, batch * d, 3.0);
                        let cos = angles.iter().map(|a| a.cos()).collect();
                        let sin = angles.iter().map(|a| a.sin()).collect();
                        (qkv, cos, sin, flags(&mut rng, batch))
                    })
                    .collect();
                let want = attention_reference(&a, &inputs);
                let items = (batch * heads) as u32;
                for (append, attend) in [
                    (LAUNCHES[0], (1, 32)),
                    (LAUNCHES[1], (3, 64)),
                    (LAUNCHES[2], (items, 128)),
                    (LAUNCHES[3], (64, 256)),
                ] {
                    let at = format!(
                        "B {batch} h {heads} k {kv_heads} d {d} steps {steps} rope {rope} {append:?} {attend:?}"
                    );
                    let got = in_both_schedules(&at, |s| {
                        attention_on_shim(&a, &inputs, (append, attend), s)
                    });
                    let n = got.len();
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let what = if i + 2 >= n { "cache" } else { "step output" };
                        assert_close(g, w, 1e-5, &format!("{at}: {what} {i}"));
                    }
                    // Keys and values are stored, not computed: the same bytes without RoPE.
                    if !rope {
                        assert_eq!(got[n - 1], want[n - 1], "{at}: values");
                        assert_eq!(got[n - 2], want[n - 2], "{at}: keys");
                    }
                }
            }
        }
    }

    struct Ssm {
        batch: usize,
        heads: usize,
        p: usize,
        groups: usize,
        n: usize,
        k: usize,
    }

    impl Ssm {
        fn inner(&self) -> usize {
            self.heads * self.p
        }
        fn channels(&self) -> usize {
            self.inner() + 2 * self.groups * self.n
        }
    }

    /// One step's inputs: the projection (B, cols) with xBC at `offset`, Δ (B, H) and the
    /// rows' flags; and the weights: conv w (ch, K), bias (ch), A (H), D (H).
    struct SsmWeights {
        w: Vec<f32>,
        bias: Vec<f32>,
        a: Vec<f32>,
        d: Vec<f32>,
    }

    const OFFSET: usize = 3;

    fn ssm_on_shim(
        s: &Ssm,
        weights: &SsmWeights,
        steps: &[(Vec<f32>, Vec<f32>, Vec<u32>)],
        launch: (u32, u32),
        schedule: Schedule,
    ) -> Vec<Vec<f32>> {
        let shim = Shim { schedule };
        let (b, ch) = (s.batch, s.channels());
        let cols = ch + OFFSET + 2;
        let up = |v: &[f32]| shim.upload_f32(v).unwrap();
        let (w, bias, a, d) = (
            up(&weights.w),
            up(&weights.bias),
            up(&weights.a),
            up(&weights.d),
        );
        let floats = |n: usize| shim.alloc(n * 4).unwrap();
        let (window, conv, state, y) = (
            floats(b * s.k * ch),
            floats(b * ch),
            floats(b * s.inner() * s.n),
            floats(b * s.inner()),
        );
        let mut out = Vec::new();
        for (proj, dt, flags) in steps {
            assert_eq!(proj.len(), b * cols);
            let (proj, dt, active) = (up(proj), up(dt), shim.upload_u32(flags).unwrap());
            let args = [
                Arg::Ptr(&proj, 0),
                Arg::I32(cols as i32),
                Arg::I32(OFFSET as i32),
                Arg::Ptr(&w, 0),
                Arg::Ptr(&bias, 0),
                Arg::Ptr(&window, 0),
                Arg::Ptr(&active, 0),
                Arg::Ptr(&conv, 0),
                Arg::I32(b as i32),
                Arg::I32(ch as i32),
                Arg::I32(s.k as i32),
            ];
            launch_on(&shim, "decode_conv_step_f32", launch, &args);
            let args = [
                Arg::Ptr(&conv, 0),
                Arg::Ptr(&dt, 0),
                Arg::Ptr(&a, 0),
                Arg::Ptr(&d, 0),
                Arg::Ptr(&state, 0),
                Arg::Ptr(&active, 0),
                Arg::Ptr(&y, 0),
            ];
            let sizes = [b, s.heads, s.p, s.groups, s.n].map(|v| Arg::I32(v as i32));
            launch_on(
                &shim,
                "decode_ssm_step_f32",
                launch,
                &[&args[..], &sizes].concat(),
            );
            out.push(shim.read_f32(&conv, 0, b * ch).unwrap());
            out.push(shim.read_f32(&y, 0, b * s.inner()).unwrap());
        }
        out.push(shim.read_f32(&window, 0, b * s.k * ch).unwrap());
        out.push(shim.read_f32(&state, 0, b * s.inner() * s.n).unwrap());
        out
    }

    /// ops/model's `Mamba2::step` as loops: roll the window (newest last), SiLU of the
    /// convolution, then S = exp(Δ·A)·S + Δ·x ⊗ B, y = S·C + D·x; a row that sits the step out
    /// keeps its window and state as they were.
    fn ssm_reference(
        s: &Ssm,
        weights: &SsmWeights,
        steps: &[(Vec<f32>, Vec<f32>, Vec<u32>)],
    ) -> Vec<Vec<f32>> {
        let (b, ch, inner, n, k) = (s.batch, s.channels(), s.inner(), s.n, s.k);
        let cols = ch + OFFSET + 2;
        let mut window = vec![0f32; b * k * ch];
        let mut state = vec![0f64; b * inner * n];
        let mut out = Vec::new();
        for (proj, dt, flags) in steps {
            let mut conv = vec![0f32; b * ch];
            let mut y = vec![0f32; b * inner];
            for r in 0..b {
                let win = &mut window[r * k * ch..(r + 1) * k * ch];
                let mut rolled: Vec<f32> = win[ch..].to_vec();
                rolled.extend_from_slice(&proj[r * cols + OFFSET..r * cols + OFFSET + ch]);
                for c in 0..ch {
                    let pre = weights.bias[c] as f64
                        + (0..k)
                            .map(|j| rolled[j * ch + c] as f64 * weights.w[c * k + j] as f64)
                            .sum::<f64>();
                    conv[r * ch + c] = (pre / (1.0 + (-pre).exp())) as f32;
                }
                let active = flags[r] != 0;
                if active {
                    win.copy_from_slice(&rolled);
                }
                let row = &conv[r * ch..(r + 1) * ch];
                for col in 0..inner {
                    let h = col / s.p;
                    let g = h / (s.heads / s.groups);
                    let (x, delta) = (row[col] as f64, dt[r * s.heads + h] as f64);
                    let decay = (delta * weights.a[h] as f64).exp();
                    let mut acc = 0.0;
                    for i in 0..n {
                        let at = (r * inner + col) * n + i;
                        let bm = row[inner + g * n + i] as f64;
                        let cm = row[inner + s.groups * n + g * n + i] as f64;
                        let next = state[at] * decay + delta * x * bm;
                        acc += next * cm;
                        if active {
                            state[at] = next;
                        }
                    }
                    y[r * inner + col] = (acc + weights.d[h] as f64 * x) as f32;
                }
            }
            out.push(conv);
            out.push(y);
        }
        out.push(window);
        out.push(state.iter().map(|v| *v as f32).collect());
        out
    }

    /// decode_conv_step_f32 and decode_ssm_step_f32, step after step with rows sitting some
    /// steps out: Mamba2::step's arithmetic, with one group and several, a window of 1 and of
    /// 4, in both schedules.
    #[test]
    fn the_mamba_step_rolls_the_window_and_the_state_as_the_cpu_step() {
        let cases = [
            Ssm {
                batch: 1,
                heads: 1,
                p: 1,
                groups: 1,
                n: 1,
                k: 1,
            },
            Ssm {
                batch: 3,
                heads: 4,
                p: 5,
                groups: 2,
                n: 3,
                k: 4,
            },
            Ssm {
                batch: 5,
                heads: 6,
                p: 8,
                groups: 1,
                n: 16,
                k: 4,
            },
        ];
        for s in cases {
            let mut rng = Rng::new((s.batch * 7 + s.heads * 3 + s.k) as u64);
            let ch = s.channels();
            let weights = SsmWeights {
                w: uniform(&mut rng, ch * s.k, 0.7),
                bias: uniform(&mut rng, ch, 0.3),
                a: uniform(&mut rng, s.heads, 1.0)
                    .iter()
                    .map(|v| -(v.abs() + 0.1))
                    .collect(),
                d: uniform(&mut rng, s.heads, 1.0),
            };
            let cols = ch + OFFSET + 2;
            let steps: Vec<_> = (0..7)
                .map(|_| {
                    let proj = uniform(&mut rng, s.batch * cols, 2.0);
                    let dt = uniform(&mut rng, s.batch * s.heads, 1.0)
                        .iter()
                        .map(|v| v.abs() + 0.05)
                        .collect();
                    (proj, dt, flags(&mut rng, s.batch))
                })
                .collect();
            let want = ssm_reference(&s, &weights, &steps);
            for launch in LAUNCHES {
                let at = format!(
                    "B {} H {} P {} G {} N {} K {} {launch:?}",
                    s.batch, s.heads, s.p, s.groups, s.n, s.k
                );
                let got = in_both_schedules(&at, |sched| {
                    ssm_on_shim(&s, &weights, &steps, launch, sched)
                });
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_close(g, w, 1e-5, &format!("{at}: output {i}"));
                }
                // The window is stored, not computed.
                assert_eq!(got[got.len() - 2], want[want.len() - 2], "{at}: window");
            }
        }
    }
}
