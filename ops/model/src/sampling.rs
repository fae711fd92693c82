//! Turning next-token logits into completions: temperature, top-k and nucleus (top-p)
//! sampling, stop tokens and stop strings, batched over prompts on the cached decoder
//! ([`super::decode`]).
//!
//! ```text
//! p = softmax(logits / temperature)          temperature 0: argmax instead (first index on ties)
//! keep the top_k most likely tokens, then the smallest most-likely prefix of them whose
//!   mass (renormalised over what top_k kept) is ≥ top_p
//! draw one token from what is kept, in proportion to p        (one uniform from the row's Rng)
//! ```
//!
//! Ranking sorts by probability, ties by token index, so the kept set is always well defined.
//! Every row draws from its own [`Rng`]: a row's completion depends on its prompt and its
//! generator only, never on the other rows of the batch. A row finishes on a stop id (not part
//! of its completion), when a caller's check says so (stop strings: [`StopStrings`]), or after
//! `max_tokens`.

use super::net::Model;
use super::params::Rng;
use candle_core::Result;

/// How tokens are drawn from the logits.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Logits are divided by this; 0 means greedy (argmax).
    pub temperature: f64,
    /// Nucleus: keep the smallest set of most likely tokens whose probability is ≥ `top_p`.
    pub top_p: f64,
    /// Keep only the `k` most likely tokens first.
    pub top_k: Option<usize>,
    /// New tokens per completion at most.
    pub max_tokens: usize,
}

impl Sampling {
    /// Argmax decoding of at most `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> Sampling {
        Sampling {
            temperature: 0.0,
            top_p: 1.0,
            top_k: None,
            max_tokens,
        }
    }

    /// One token from `logits`. Greedy (temperature 0) draws nothing from `rng`; otherwise
    /// exactly one uniform.
    pub fn sample(&self, logits: &[f32], rng: &mut Rng) -> u32 {
        if self.temperature <= 0.0 {
            return argmax(logits);
        }
        let kept = self.nucleus(logits);
        let total: f64 = kept.iter().map(|(_, p)| p).sum();
        let mut u = rng.uniform() * total;
        for (i, p) in &kept {
            if u < *p {
                return *i;
            }
            u -= p;
        }
        // Rounding left u just past the end: the last kept token.
        kept.last().map_or(0, |(i, _)| *i)
    }

    /// The tokens sampling may draw, most likely first, each with its weight
    /// `exp((logit − max logit) / temperature)` (its tempered-softmax probability up to one common
    /// factor). Never empty for non-empty logits.
    pub fn nucleus(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        let t = self.temperature.max(f64::MIN_POSITIVE);
        let max = logits
            .iter()
            .map(|l| *l as f64)
            .fold(f64::NEG_INFINITY, f64::max);
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, l)| (i as u32, ((*l as f64 - max) / t).exp()))
            .collect();
        // Most likely first; the stable sort keeps ties in index order.
        probs.sort_by(|a, b| b.1.total_cmp(&a.1));
        if let Some(k) = self.top_k {
            probs.truncate(k.max(1));
        }
        let total: f64 = probs.iter().map(|(_, p)| p).sum();
        let mut mass = 0.0;
        let mut keep = probs.len();
        for (n, (_, p)) in probs.iter().enumerate() {
            mass += p / total;
            if mass >= self.top_p {
                keep = n + 1;
                break;
            }
        }
        probs.truncate(keep.max(1));
        probs
    }
}

/// Index of the largest value; the first one on ties.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// One row's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The generated ids, the stop id excluded.
    pub ids: Vec<u32>,
    /// A stop id or the caller's check ended it (false: it ran to `max_tokens`).
    pub stopped: bool,
}

/// What generation decodes with: feed one token per row (`None`: the row sits this step out,
/// as left padding and finished rows do) and get each row's next-token logits. [`Model`]'s
/// cached decoder on the CPU ([`CpuDecoder`]), or ops/train's on a GPU.
pub trait Decoder {
    /// The rows it decodes.
    fn rows(&self) -> usize;
    /// One step: `ids` has one entry per row; returns `rows` logit rows of the vocabulary.
    fn step(&mut self, ids: &[Option<u32>]) -> Result<Vec<Vec<f32>>>;
}

/// [`Model::decode_step`] with its state: the CPU's [`Decoder`].
pub struct CpuDecoder<'m> {
    model: &'m Model,
    state: super::decode::DecodeState,
}

impl<'m> CpuDecoder<'m> {
    /// Empty caches for `rows` rows.
    pub fn new(model: &'m Model, rows: usize) -> Result<CpuDecoder<'m>> {
        Ok(CpuDecoder {
            model,
            state: model.start_decode(rows)?,
        })
    }
}

impl Decoder for CpuDecoder<'_> {
    fn rows(&self) -> usize {
        self.state.batch
    }
    fn step(&mut self, ids: &[Option<u32>]) -> Result<Vec<Vec<f32>>> {
        self.model
            .decode_step(&mut self.state, ids)?
            .to_vec2::<f32>()
    }
}

/// Complete every prompt (a batch, left padded) with the tokens `sampling` draws, row `r`
/// drawing from `rngs[r]`, until a stop id or `max_tokens`.
pub fn generate(
    model: &Model,
    prompts: &[Vec<u32>],
    sampling: &Sampling,
    stop_ids: &[u32],
    rngs: &mut [Rng],
) -> Result<Vec<Completion>> {
    generate_until(model, prompts, sampling, stop_ids, rngs, |_, _| false)
}

/// The steps a decoder of these prompts holds: the longest prompt plus `max_tokens` new ones,
/// checked against the model's `max_seq`; 0 when nothing decodes (no prompts, or no new
/// tokens).
pub fn decode_length(model: &Model, prompts: &[Vec<u32>], max_tokens: usize) -> Result<usize> {
    if prompts.is_empty() || max_tokens == 0 {
        return Ok(0);
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    if longest + max_tokens > model.cfg.max_seq {
        candle_core::bail!(
            "a prompt of {longest} tokens + {max_tokens} new ones exceeds the model's max_seq {}",
            model.cfg.max_seq
        )
    }
    Ok(longest + max_tokens)
}

/// [`generate`], where a row also finishes (as stopped) once `done(row, ids so far)` says so;
/// it is asked after every token the row keeps.
pub fn generate_until(
    model: &Model,
    prompts: &[Vec<u32>],
    sampling: &Sampling,
    stop_ids: &[u32],
    rngs: &mut [Rng],
    done: impl FnMut(usize, &[u32]) -> bool,
) -> Result<Vec<Completion>> {
    decode_length(model, prompts, sampling.max_tokens)?;
    let mut decoder = CpuDecoder::new(model, prompts.len())?;
    generate_with(&mut decoder, prompts, sampling, stop_ids, rngs, done)
}

/// Feeds `prompts` to a fresh `decoder`, one token a step, left padded to the longest
/// (padding steps are `None`, so they leave no trace); returns each row's logits of its first
/// new token. Every prompt needs at least one token.
pub fn prefill(decoder: &mut dyn Decoder, prompts: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
    if let Some(r) = prompts.iter().position(Vec::is_empty) {
        candle_core::bail!("prompt {r} is empty: decoding needs at least one token")
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut rows = Vec::new();
    for s in 0..longest {
        let ids: Vec<Option<u32>> = prompts
            .iter()
            .map(|p| (s + p.len()).checked_sub(longest).map(|i| p[i]))
            .collect();
        rows = decoder.step(&ids)?;
    }
    Ok(rows)
}

/// [`generate_until`] on any [`Decoder`] of `prompts.len()` rows, fresh (nothing fed yet) and
/// long enough for the longest prompt plus `max_tokens` ([`decode_length`]); the prompts go in
/// through [`prefill`].
pub fn generate_with(
    decoder: &mut dyn Decoder,
    prompts: &[Vec<u32>],
    sampling: &Sampling,
    stop_ids: &[u32],
    rngs: &mut [Rng],
    mut done: impl FnMut(usize, &[u32]) -> bool,
) -> Result<Vec<Completion>> {
    let b = prompts.len();
    if rngs.len() != b || decoder.rows() != b {
        candle_core::bail!(
            "generate: {} generators and a decoder of {} rows for {b} prompts",
            rngs.len(),
            decoder.rows()
        )
    }
    let mut out: Vec<Completion> = vec![
        Completion {
            ids: Vec::new(),
            stopped: false,
        };
        b
    ];
    if b == 0 || sampling.max_tokens == 0 {
        return Ok(out);
    }
    let mut rows = prefill(decoder, prompts)?;
    let mut finished = vec![false; b];
    loop {
        let mut next = vec![None; b];
        for r in 0..b {
            if finished[r] {
                continue;
            }
            let id = sampling.sample(&rows[r], &mut rngs[r]);
            let c = &mut out[r];
            if stop_ids.contains(&id) {
                c.stopped = true;
            } else {
                c.ids.push(id);
                c.stopped = done(r, &c.ids);
                next[r] = Some(id);
            }
            finished[r] = c.stopped || c.ids.len() >= sampling.max_tokens;
            if finished[r] {
                next[r] = None;
            }
        }
        if finished.iter().all(|f| *f) {
            return Ok(out);
        }
        rows = decoder.step(&next)?;
    }
}

/// [`generate_until`] with the rows cut into `threads` contiguous chunks, each generated on
/// its own single-threaded worker ([`kernels::workers`]): for a small model, batches side by
/// side use the cores better than candle's threads inside one batch. Rows are independent and
/// each samples from its own generator, so the chunking does not change a row's completion.
/// `done` gets the row's index in `prompts`.
pub fn generate_split(
    model: &Model,
    prompts: &[Vec<u32>],
    sampling: &Sampling,
    stop_ids: &[u32],
    rngs: &mut [Rng],
    threads: usize,
    done: impl Fn(usize, &[u32]) -> bool + Sync,
) -> Result<Vec<Completion>> {
    if rngs.len() != prompts.len() {
        candle_core::bail!(
            "generate: {} generators for {} prompts",
            rngs.len(),
            prompts.len()
        )
    }
    let size = prompts.len().div_ceil(threads.max(1)).max(1);
    let chunks: Vec<std::sync::Mutex<&mut [Rng]>> =
        rngs.chunks_mut(size).map(std::sync::Mutex::new).collect();
    let done = &done;
    let parts = kernels::workers::map(chunks.len(), threads, |c| {
        let mut rngs = chunks[c].lock().unwrap_or_else(|p| p.into_inner());
        let from = c * size;
        let rows = &prompts[from..(from + size).min(prompts.len())];
        generate_until(model, rows, sampling, stop_ids, &mut rngs, |r, ids| {
            done(from + r, ids)
        })
    })
    .map_err(candle_core::Error::wrap)?;
    let mut out = Vec::with_capacity(prompts.len());
    for part in parts {
        out.extend(part?);
    }
    Ok(out)
}

/// Stop strings: a completion ends at the first of them in its decoded text.
pub struct StopStrings<'a> {
    pub tokenizer: &'a tokenizers::Tokenizer,
    pub stops: &'a [String],
}

impl StopStrings<'_> {
    /// The decoded text of `ids` (special tokens skipped) cut before the first stop string,
    /// and whether one was found.
    pub fn cut(&self, ids: &[u32]) -> std::result::Result<(String, bool), String> {
        let text = self
            .tokenizer
            .decode(ids, true)
            .map_err(|e| format!("cannot decode: {e}"))?;
        Ok(cut_at_stop(&text, self.stops))
    }

    /// Whether the decoded `ids` contain a stop string: the check for [`generate_until`]. Text
    /// that does not decode holds none.
    pub fn hit(&self, ids: &[u32]) -> bool {
        !self.stops.is_empty() && self.cut(ids).is_ok_and(|(_, hit)| hit)
    }
}

/// `text` up to the earliest stop string (by position; empty stops are ignored), and whether
/// one was found.
pub fn cut_at_stop(text: &str, stops: &[String]) -> (String, bool) {
    let first = stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min();
    match first {
        Some(at) => (text[..at].to_string(), true),
        None => (text.to_string(), false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::layers::Layout;

    fn model(seed: u64) -> Model {
        let cfg: ModelConfig = serde_json::from_value(serde_json::json!({
            "pattern": "M*-E*", "hidden": 16, "heads": 4, "kv_heads": 2, "head_dim": 4,
            "ffn": 32, "max_seq": 64, "init_std": 0.5,
            "mamba": {"heads": 2, "head_dim": 8, "state": 4, "chunk": 4},
            "moe": {"experts": 4, "top_k": 2, "expert_ffn": 8}
        }))
        .unwrap();
        Model::new(&cfg, 40, seed).unwrap()
    }

    fn prompts() -> Vec<Vec<u32>> {
        vec![vec![5, 6, 7, 8, 9], vec![11, 12], vec![1, 2, 3], vec![30]]
    }

    fn rngs(seed: u64, n: usize) -> Vec<Rng> {
        (0..n).map(|i| Rng::new(seed * 1000 + i as u64)).collect()
    }

    fn warm(t: f64) -> Sampling {
        Sampling {
            temperature: t,
            top_p: 1.0,
            top_k: None,
            max_tokens: 8,
        }
    }

    /// The uncached decoder `eval::greedy` used to be: the whole forward for every token, left
    /// padding in a segment of its own.
    fn uncached_greedy(model: &Model, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
        let b = prompts.len();
        let longest = prompts.iter().map(Vec::len).max().unwrap();
        let mut rows: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                std::iter::repeat_n(0, longest - p.len())
                    .chain(p.iter().copied())
                    .collect()
            })
            .collect();
        let mut out = vec![Vec::new(); b];
        for _ in 0..max_tokens {
            let t = rows[0].len();
            let mut layout = Layout::plain(b, t);
            for (r, p) in prompts.iter().enumerate() {
                let pad = longest - p.len();
                for i in 0..t {
                    layout.segments[r * t + i] = u32::from(i >= pad);
                    layout.positions[r * t + i] = if i >= pad { i - pad } else { i } as u32;
                }
            }
            let ids: Vec<u32> = rows.iter().flatten().copied().collect();
            let logits = model.logits(&ids, &layout).unwrap();
            let last = logits.narrow(1, t - 1, 1).unwrap().squeeze(1).unwrap();
            for (r, l) in last.to_vec2::<f32>().unwrap().iter().enumerate() {
                let next = argmax(l);
                rows[r].push(next);
                out[r].push(next);
            }
        }
        out
    }

    #[test]
    fn cached_greedy_equals_the_uncached_decoder() {
        let m = model(3);
        let p = prompts();
        let cached = generate(&m, &p, &Sampling::greedy(10), &[], &mut rngs(0, 4)).unwrap();
        let reference = uncached_greedy(&m, &p, 10);
        for (c, want) in cached.iter().zip(&reference) {
            assert_eq!(&c.ids, want);
            assert!(!c.stopped);
        }
        // Not a constant sequence (which any decoder would reproduce).
        assert!(reference.iter().any(|r| r.iter().any(|t| *t != r[0])));
    }

    #[test]
    fn stop_ids_end_a_row_and_are_not_kept() {
        let m = model(3);
        let p = prompts();
        let free = generate(&m, &p, &Sampling::greedy(6), &[], &mut rngs(0, 4)).unwrap();
        let stop = free[0].ids[2];
        let got = generate(&m, &p, &Sampling::greedy(6), &[stop], &mut rngs(0, 4)).unwrap();
        let cut = free[0].ids.iter().position(|t| *t == stop).unwrap();
        assert_eq!(got[0].ids, free[0].ids[..cut]);
        assert!(got[0].stopped);
        for (g, f) in got.iter().zip(&free) {
            // Every row is the free run up to its first stop id.
            let end = f.ids.iter().position(|t| *t == stop).unwrap_or(f.ids.len());
            assert_eq!(g.ids, f.ids[..end]);
            assert_eq!(g.stopped, end < f.ids.len());
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_completions_and_another_seed_others() {
        let m = model(4);
        let p = prompts();
        let s = warm(1.5);
        let a = generate(&m, &p, &s, &[], &mut rngs(1, 4)).unwrap();
        let b = generate(&m, &p, &s, &[], &mut rngs(1, 4)).unwrap();
        let c = generate(&m, &p, &s, &[], &mut rngs(2, 4)).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(
            a,
            generate(&m, &p, &Sampling::greedy(8), &[], &mut rngs(1, 4)).unwrap()
        );
    }

    #[test]
    fn a_batched_row_equals_the_row_alone() {
        let m = model(5);
        let p = prompts();
        let s = Sampling {
            temperature: 0.9,
            top_p: 0.9,
            top_k: Some(20),
            max_tokens: 8,
        };
        let stops = [7u32];
        let together = generate(&m, &p, &s, &stops, &mut rngs(3, 4)).unwrap();
        let mut all = rngs(3, 4);
        for (r, prompt) in p.iter().enumerate() {
            let alone = generate(
                &m,
                std::slice::from_ref(prompt),
                &s,
                &stops,
                &mut all[r..r + 1],
            )
            .unwrap();
            assert_eq!(alone[0], together[r], "row {r}");
        }
    }

    #[test]
    fn rows_split_over_workers_complete_as_in_one_batch() {
        let m = model(6);
        let p: Vec<Vec<u32>> = prompts().into_iter().cycle().take(7).collect();
        let s = warm(1.2);
        let stops = [7u32];
        let together = generate(&m, &p, &s, &stops, &mut rngs(4, 7)).unwrap();
        for threads in [1, 2, 3] {
            let split =
                generate_split(&m, &p, &s, &stops, &mut rngs(4, 7), threads, |_, _| false).unwrap();
            assert_eq!(split, together, "{threads} threads");
        }
        // `done` sees each row's index in the whole batch.
        let split = generate_split(&m, &p, &s, &[], &mut rngs(4, 7), 3, |r, ids| {
            r == 5 && !ids.is_empty()
        })
        .unwrap();
        assert_eq!(split[5].ids.len(), 1);
        assert!(split[5].stopped);
        assert!(
            split
                .iter()
                .enumerate()
                .all(|(r, c)| r == 5 || c.ids.len() > 1)
        );
    }

    #[test]
    fn degenerate_settings_are_argmax() {
        let m = model(6);
        let p = prompts();
        let greedy = generate(&m, &p, &Sampling::greedy(8), &[], &mut rngs(0, 4)).unwrap();
        let tiny_p = Sampling {
            top_p: 1e-6,
            ..warm(1.0)
        };
        let k1 = Sampling {
            top_k: Some(1),
            ..warm(1.0)
        };
        for s in [tiny_p, k1] {
            assert_eq!(generate(&m, &p, &s, &[], &mut rngs(9, 4)).unwrap(), greedy);
        }
        // On plain logits too, with a tie: the first index wins.
        let logits = [0.5f32, 2.0, -1.0, 2.0];
        let mut rng = Rng::new(1);
        for s in [
            Sampling::greedy(1),
            Sampling {
                top_k: Some(1),
                ..warm(1.0)
            },
        ] {
            assert_eq!(s.sample(&logits, &mut rng), 1);
        }
    }

    #[test]
    fn sampled_frequencies_follow_the_tempered_softmax_inside_the_nucleus() {
        let logits = [1.0f32, 0.0, 2.0, -1.0, 0.5, -3.0];
        let t = 0.8;
        let e: Vec<f64> = logits.iter().map(|l| (*l as f64 / t).exp()).collect();
        let z: f64 = e.iter().sum();
        let p: Vec<f64> = e.iter().map(|v| v / z).collect();
        let draws = 200_000;
        let mut rng = Rng::new(42);

        // All tokens: frequencies ≈ softmax(logits / T).
        let mut count = [0usize; 6];
        for _ in 0..draws {
            count[warm(t).sample(&logits, &mut rng) as usize] += 1;
        }
        for i in 0..6 {
            let f = count[i] as f64 / draws as f64;
            let sd = (p[i] * (1.0 - p[i]) / draws as f64).sqrt();
            assert!(
                (f - p[i]).abs() < 5.0 * sd + 1e-4,
                "token {i}: {f} vs {}",
                p[i]
            );
        }

        // top_p = 0.9: by probability the order is 2, 0, 4, 1, 3, 5; the nucleus is the
        // shortest prefix with mass ≥ 0.9, the others never appear, and the kept ones keep
        // their relative odds.
        let mut order: Vec<usize> = (0..6).collect();
        order.sort_by(|a, b| p[*b].total_cmp(&p[*a]));
        let mut mass = 0.0;
        let nucleus: Vec<usize> = order
            .iter()
            .copied()
            .take_while(|i| {
                let inside = mass < 0.9;
                mass += p[*i];
                inside
            })
            .collect();
        assert_eq!(nucleus, [2, 0, 4]);
        let s = Sampling {
            top_p: 0.9,
            ..warm(t)
        };
        let kept: f64 = nucleus.iter().map(|i| p[*i]).sum();
        let mut count = [0usize; 6];
        for _ in 0..draws {
            count[s.sample(&logits, &mut rng) as usize] += 1;
        }
        for i in 0..6 {
            let f = count[i] as f64 / draws as f64;
            if nucleus.contains(&i) {
                let q = p[i] / kept;
                let sd = (q * (1.0 - q) / draws as f64).sqrt();
                assert!((f - q).abs() < 5.0 * sd + 1e-4, "token {i}: {f} vs {q}");
            } else {
                assert_eq!(count[i], 0, "token {i} is outside the nucleus");
            }
        }

        // top_k = 2 keeps exactly the two most likely.
        let s = Sampling {
            top_k: Some(2),
            ..warm(t)
        };
        let kept: Vec<u32> = s.nucleus(&logits).iter().map(|(i, _)| *i).collect();
        assert_eq!(kept, [2, 0]);
    }

    #[test]
    fn nucleus_ties_are_broken_by_index() {
        let s = Sampling {
            top_p: 0.5,
            ..warm(1.0)
        };
        let kept: Vec<u32> = s
            .nucleus(&[1.0, 3.0, 3.0, 3.0])
            .iter()
            .map(|(i, _)| *i)
            .collect();
        assert_eq!(kept, [1, 2]);
    }

    fn word_tokenizer() -> tokenizers::Tokenizer {
        let vocab: serde_json::Map<String, serde_json::Value> =
            ["<unk>", "the", "answer", "is", "42", "STOP", "more", "text"]
                .iter()
                .enumerate()
                .map(|(i, w)| (w.to_string(), serde_json::json!(i)))
                .collect();
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
        });
        json.to_string().parse().unwrap()
    }

    #[test]
    fn stop_strings_cut_the_response() {
        let tok = word_tokenizer();
        let stops = vec!["STOP".to_string(), "answer is 4".to_string()];
        let s = StopStrings {
            tokenizer: &tok,
            stops: &stops,
        };
        // "the answer is 42 STOP more": the earliest stop string wins, wherever it is listed.
        let ids = [1, 2, 3, 4, 5, 6];
        assert_eq!(s.cut(&ids).unwrap(), ("the ".to_string(), true));
        assert!(s.hit(&ids));
        assert_eq!(
            s.cut(&[1, 6, 7]).unwrap(),
            ("the more text".to_string(), false)
        );
        assert!(!s.hit(&[1, 6, 7]));
        assert_eq!(
            cut_at_stop("a b STOP c", &["STOP".into()]),
            ("a b ".into(), true)
        );
        assert!(
            !StopStrings {
                tokenizer: &tok,
                stops: &[]
            }
            .hit(&ids)
        );

        // In generation: a row stops as soon as its text holds a stop string.
        let m = model(3);
        let p = prompts();
        let free = generate(&m, &p, &Sampling::greedy(8), &[], &mut rngs(0, 4)).unwrap();
        let marker = free[1].ids[3];
        let got = generate_until(
            &m,
            &p,
            &Sampling::greedy(8),
            &[],
            &mut rngs(0, 4),
            |r, ids| r == 1 && ids.contains(&marker),
        )
        .unwrap();
        let at = free[1].ids.iter().position(|t| *t == marker).unwrap();
        assert_eq!(got[1].ids, free[1].ids[..=at]);
        assert!(got[1].stopped);
        assert_eq!(got[0], free[0]);
    }

    #[test]
    fn a_prompt_too_long_for_max_seq_is_an_error() {
        let m = model(3);
        let long = vec![vec![1u32; 60]];
        assert!(generate(&m, &long, &Sampling::greedy(8), &[], &mut rngs(0, 1)).is_err());
        assert!(generate(&m, &prompts(), &Sampling::greedy(8), &[], &mut rngs(0, 1)).is_err());
    }
}
