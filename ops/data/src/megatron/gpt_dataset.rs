//! Megatron's `GPTDataset` and `BlendedDataset` index construction, re-implemented.
//!
//! What a pretraining data loader must reproduce (Megatron-LM `megatron/core/datasets/`
//! `gpt_dataset.py`, `blended_dataset.py`, `helpers.cpp`; see also docs/parity.md):
//!
//! 1. **Epochs** ([`num_epochs`]): the smallest `E` with `E·tokens_per_epoch ≥
//!    num_samples·S + add_extra_token` (`_get_num_epochs`); whether the final epoch is shuffled
//!    separately ([`separate_final_epoch`]): when it contributes fewer than
//!    `int(0.80·samples_per_epoch)` samples (`_build_document_sample_shuffle_indices`).
//! 2. **Document index** ([`build_document_index`]): the split's documents repeated `E` times
//!    and shuffled by `numpy.random.RandomState(seed)`; with a separate final epoch, the first
//!    `E−1` epochs and the last one are shuffled apart and concatenated (`_build_document_index`).
//! 3. **Sample index** ([`build_sample_index`]): `helpers.cpp: build_sample_idx`; rows are
//!    `(position in document index, token offset)`, each sample spans `S + 1` tokens and
//!    consecutive samples overlap by one token.
//! 4. **Shuffle index** ([`build_shuffle_index`]): `arange(num_samples)` shuffled, with the
//!    final-epoch samples shuffled apart when the final epoch is separate (`_build_shuffle_index`).
//! 5. **getitem** ([`sample_tokens`]): sample `i`'s `S + 1` tokens (`GPTDataset.__getitem__`).
//! 6. **Blending** ([`blend_indices`]): `helpers.cpp: build_blending_indices`, the greedy
//!    max-error rule (`BlendedDataset` in `blended_dataset.py`).
//!
//! # Randomness
//!
//! Megatron shuffles with `numpy.random.RandomState(seed).shuffle`, and it threads **one**
//! `RandomState` through the document-index shuffle(s) and then the shuffle-index shuffle(s).
//! [`NumpyRandomState`] re-implements that legacy generator bit for bit for `u32` seeds
//! (MT19937 seeded by `init_genrand`, `shuffle` = Fisher–Yates from the end drawing
//! `random_interval(i)`, i.e. masked rejection sampling on the low bits of one 32-bit output,
//! or of a 64-bit output made of two draws when `i ≥ 2^32`). The tests compare against values
//! printed by numpy 2.4.6 running the Megatron logic.
//!
//! The seed-taking conveniences [`build_document_index`] and [`build_shuffle_index`] each start
//! a **fresh** `RandomState(seed)`; that equals Megatron only for the document index. To get
//! Megatron's shuffle index too (same stream continued), use [`build_gpt_indices`] or the
//! `*_with` variants with one shared [`NumpyRandomState`].

use crate::random::NumpyRandomState;

/// Megatron's threshold for shuffling the final epoch separately (`separate_final_epoch`).
const SEPARATE_FINAL_EPOCH_THRESHOLD: f64 = 0.80;

fn err<T>(message: impl Into<String>) -> crate::Result<T> {
    Err(crate::Error::new(message))
}

/// Number of epochs needed to draw `num_samples` samples of `seq_length` tokens
/// (`GPTDataset._get_num_epochs`): the smallest `E ≥ 1` with
/// `E·tokens_per_epoch ≥ num_samples·seq_length + add_extra_token`; 1 when `num_samples` is
/// `None`. An empty epoch can never cover a request, which is an error.
pub fn num_epochs(
    tokens_per_epoch: u64,
    num_samples: Option<u64>,
    seq_length: usize,
    add_extra_token: bool,
) -> crate::Result<usize> {
    let Some(num_samples) = num_samples else {
        return Ok(1);
    };
    let requested = num_samples
        .checked_mul(seq_length as u64)
        .and_then(|t| t.checked_add(u64::from(add_extra_token)))
        .ok_or_else(|| crate::Error::new("requested token count overflows u64"))?;
    if requested == 0 {
        return Ok(1);
    }
    if tokens_per_epoch == 0 {
        return err("the split has no tokens, so no number of epochs covers the request");
    }
    Ok(requested.div_ceil(tokens_per_epoch).max(1) as usize)
}

/// Whether the final epoch is shuffled on its own (`separate_final_epoch`): with `E > 1`, when the
/// samples it contributes, `num_samples − ((E−1)·tokens_per_epoch − extra) // S`, are fewer
/// than `int(0.80 · ((tokens_per_epoch − extra) // S))`.
pub fn separate_final_epoch(
    tokens_per_epoch: u64,
    num_samples: u64,
    seq_length: usize,
    num_epochs: usize,
    add_extra_token: bool,
) -> bool {
    if num_epochs <= 1 || seq_length == 0 {
        return false;
    }
    let extra = u64::from(add_extra_token);
    let s = seq_length as u64;
    let sans_final = ((num_epochs as u64 - 1) * tokens_per_epoch).saturating_sub(extra) / s;
    let from_final = num_samples.saturating_sub(sans_final);
    let per_epoch = tokens_per_epoch.saturating_sub(extra) / s;
    // Python `int(0.8 * x)` truncates toward zero; x is non-negative here.
    let threshold = (SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch as f64) as u64;
    from_final < threshold
}

/// `_build_document_index` for documents `0..num_docs` with a fresh `RandomState(seed)`
/// (`gpt_dataset.py`). See [`build_document_index_with`] for explicit document ids and a shared
/// generator.
pub fn build_document_index(
    num_docs: usize,
    num_epochs: usize,
    seed: u32,
    separate_final_epoch: bool,
) -> Vec<u32> {
    let documents: Vec<u32> = (0..num_docs as u32).collect();
    let mut rng = NumpyRandomState::new(seed);
    build_document_index_with(&documents, num_epochs, &mut rng, separate_final_epoch)
}

/// `gpt_dataset.py: _build_document_index`: `documents` repeated `num_epochs` times (epoch-major)
/// and shuffled with `rng`; with `separate_final_epoch` (and `E > 1`) the first `E−1` epochs
/// are shuffled together first, then the last epoch alone, and the two are concatenated.
pub fn build_document_index_with(
    documents: &[u32],
    num_epochs: usize,
    rng: &mut NumpyRandomState,
    separate_final_epoch: bool,
) -> Vec<u32> {
    let repeat = |epochs: usize, rng: &mut NumpyRandomState| {
        let mut index: Vec<u32> = Vec::with_capacity(epochs * documents.len());
        for _ in 0..epochs {
            index.extend_from_slice(documents);
        }
        rng.shuffle(&mut index);
        index
    };
    if !separate_final_epoch || num_epochs <= 1 {
        return repeat(num_epochs, rng);
    }
    let mut index = repeat(num_epochs - 1, rng);
    index.extend(repeat(1, rng));
    index
}

/// `helpers.cpp: build_sample_idx` with `drop_last_partial_sequence = true`.
///
/// `sizes[d]` is the token count of document id `d`; `doc_index` holds document ids (the
/// output of [`build_document_index`]). Returns `num_samples + 1` rows `(position in doc_index,
/// token offset)` with `num_samples = (num_epochs·tokens_per_epoch − extra) // seq_length`;
/// sample `k` runs from row `k` to row `k + 1` inclusive of the `extra` token, so with
/// `add_extra_token` each sample has `seq_length + 1` tokens and sample `k + 1` starts on the
/// last token of sample `k`. Row 0 is `(0, 0)`.
pub fn build_sample_index(
    sizes: &[i32],
    doc_index: &[u32],
    seq_length: usize,
    num_epochs: usize,
    tokens_per_epoch: u64,
    add_extra_token: bool,
) -> crate::Result<Vec<(usize, usize)>> {
    if seq_length == 0 {
        return err("seq_length must be positive");
    }
    let extra = i64::from(add_extra_token);
    let total = (num_epochs as u64)
        .checked_mul(tokens_per_epoch)
        .ok_or_else(|| crate::Error::new("num_epochs × tokens_per_epoch overflows"))?;
    let num_samples = (total as i64 - extra).max(0) as usize / seq_length;
    let size_of = |position: usize| -> crate::Result<i64> {
        let doc = *doc_index.get(position).ok_or_else(|| {
            crate::Error::new(format!(
                "document index exhausted at position {position}: tokens_per_epoch or num_epochs \
                 exceed what the documents hold"
            ))
        })?;
        match sizes.get(doc as usize) {
            Some(&n) if n >= 0 => Ok(i64::from(n)),
            Some(&n) => err(format!("document {doc} has negative size {n}")),
            None => err(format!(
                "document id {doc} out of range ({} sizes)",
                sizes.len()
            )),
        }
    };

    let mut rows = Vec::with_capacity(num_samples + 1);
    let mut position = 0usize;
    let mut offset: i64 = 0;
    rows.push((0, 0));
    while rows.len() <= num_samples {
        let mut remaining = seq_length as i64 + extra;
        while remaining != 0 {
            let document_length = size_of(position)? - offset;
            remaining -= document_length;
            if remaining <= 0 {
                // The need is met inside this document; the next sample starts `extra` tokens
                // before where this one ends (the one-token overlap).
                offset += remaining + document_length - extra;
                remaining = 0;
            } else if position + 1 == doc_index.len() {
                // Last document and still short: helpers.cpp asserts this happens only for
                // the final sample (a partial sequence); anything earlier means
                // `tokens_per_epoch`/`num_epochs` claim more tokens than `doc_index` holds.
                if rows.len() != num_samples {
                    return err(format!(
                        "documents ran out at sample {} of {num_samples}: tokens_per_epoch or \
                         num_epochs exceed what the document index holds",
                        rows.len()
                    ));
                }
                offset = size_of(position)? - extra;
                break;
            } else {
                position += 1;
                offset = 0;
            }
        }
        rows.push((position, offset.max(0) as usize));
    }
    Ok(rows)
}

/// `_build_shuffle_index` with a fresh `RandomState(seed)` (`gpt_dataset.py`): `[0, num_samples)`
/// shuffled, then `[num_samples, total_size)` shuffled separately and appended. Megatron
/// continues the document-index generator instead; see [`build_shuffle_index_with`].
pub fn build_shuffle_index(num_samples: usize, total_size: usize, seed: u32) -> Vec<usize> {
    let mut rng = NumpyRandomState::new(seed);
    build_shuffle_index_with(num_samples, total_size, &mut rng)
}

/// `_build_shuffle_index` (`gpt_dataset.py`) drawing from `rng`.
pub fn build_shuffle_index_with(
    num_samples: usize,
    total_size: usize,
    rng: &mut NumpyRandomState,
) -> Vec<usize> {
    let num_samples = num_samples.min(total_size);
    let mut first: Vec<usize> = (0..num_samples).collect();
    rng.shuffle(&mut first);
    if num_samples == total_size {
        return first;
    }
    let mut last: Vec<usize> = (num_samples..total_size).collect();
    rng.shuffle(&mut last);
    first.extend(last);
    first
}

/// Everything `GPTDataset` caches for one split: its document, sample and shuffle indices.
#[derive(Debug, Clone, PartialEq)]
pub struct GptIndices {
    pub num_epochs: usize,
    pub separate_final_epoch: bool,
    pub document_index: Vec<u32>,
    pub sample_index: Vec<(usize, usize)>,
    pub shuffle_index: Vec<usize>,
}

/// `GPTDataset._build_document_sample_shuffle_indices`: all three indices for the split's
/// `documents` (ids into `sizes`), threading one `RandomState(seed)` as Megatron does, so the
/// result equals Megatron's cached `.npy` indices.
pub fn build_gpt_indices(
    sizes: &[i32],
    documents: &[u32],
    seq_length: usize,
    num_samples: Option<u64>,
    seed: u32,
    add_extra_token: bool,
) -> crate::Result<GptIndices> {
    let mut tokens_per_epoch: u64 = 0;
    for &doc in documents {
        match sizes.get(doc as usize) {
            Some(&n) if n >= 0 => tokens_per_epoch += n as u64,
            _ => return err(format!("document id {doc} has no valid size")),
        }
    }
    let epochs = num_epochs(tokens_per_epoch, num_samples, seq_length, add_extra_token)?;
    let separate = num_samples.is_some_and(|n| {
        separate_final_epoch(tokens_per_epoch, n, seq_length, epochs, add_extra_token)
    });
    let mut rng = NumpyRandomState::new(seed);
    let document_index = build_document_index_with(documents, epochs, &mut rng, separate);
    let sample_index = build_sample_index(
        sizes,
        &document_index,
        seq_length,
        epochs,
        tokens_per_epoch,
        add_extra_token,
    )?;
    let total = sample_index.len() - 1;
    let first = if separate {
        let extra = u64::from(add_extra_token);
        (((epochs as u64 - 1) * tokens_per_epoch).saturating_sub(extra) / seq_length as u64)
            as usize
    } else {
        total
    };
    let shuffle_index = build_shuffle_index_with(first, total, &mut rng);
    Ok(GptIndices {
        num_epochs: epochs,
        separate_final_epoch: separate,
        document_index,
        sample_index,
        shuffle_index,
    })
}

/// `GPTDataset.__getitem__` token assembly: sample `i`'s tokens.
///
/// `j = shuffle_index[i]`, `(d0, o0) = sample_index[j]`, `(d1, o1) = sample_index[j + 1]`;
/// `read(doc_id, offset, len)` returns `len` tokens of document `doc_id` from `offset`. If
/// `d0 == d1` this takes `[o0, o1 + extra)` of that document, else the tail of `d0` from `o0`,
/// every document in between and the head of `d1` up to `o1 + extra`. A result shorter than
/// `seq_length + extra` is padded with `pad` (only partial sequences, which
/// [`build_sample_index`] never builds). The model sees `tokens[..S]` and labels `tokens[1..]`.
#[allow(clippy::too_many_arguments)]
pub fn sample_tokens(
    sizes: &[i32],
    doc_index: &[u32],
    sample_index: &[(usize, usize)],
    shuffle_index: &[usize],
    i: usize,
    seq_length: usize,
    add_extra_token: bool,
    pad: u32,
    mut read: impl FnMut(u32, usize, usize) -> Vec<u32>,
) -> crate::Result<Vec<u32>> {
    let extra = usize::from(add_extra_token);
    let j = *shuffle_index
        .get(i)
        .ok_or_else(|| crate::Error::new(format!("sample {i} out of range")))?;
    let (Some(&(d0, o0)), Some(&(d1, o1))) = (sample_index.get(j), sample_index.get(j + 1)) else {
        return err(format!("shuffled sample {j} has no sample-index rows"));
    };
    let doc_at = |position: usize| -> crate::Result<(u32, usize)> {
        let doc = *doc_index.get(position).ok_or_else(|| {
            crate::Error::new(format!("document position {position} out of range"))
        })?;
        let size = sizes
            .get(doc as usize)
            .and_then(|&n| usize::try_from(n).ok())
            .ok_or_else(|| crate::Error::new(format!("document id {doc} has no valid size")))?;
        Ok((doc, size))
    };
    let mut tokens = Vec::with_capacity(seq_length + extra);
    if d0 == d1 {
        let (doc, _) = doc_at(d0)?;
        tokens.extend(read(doc, o0, (o1 + extra).saturating_sub(o0)));
    } else {
        let (doc, size) = doc_at(d0)?;
        tokens.extend(read(doc, o0, size.saturating_sub(o0)));
        for position in d0 + 1..d1 {
            let (doc, size) = doc_at(position)?;
            tokens.extend(read(doc, 0, size));
        }
        let (doc, _) = doc_at(d1)?;
        tokens.extend(read(doc, 0, o1 + extra));
    }
    let want = seq_length + extra;
    if tokens.len() > want {
        return err(format!(
            "sample {i} assembled {} tokens, more than {want}",
            tokens.len()
        ));
    }
    tokens.resize(want, pad);
    Ok(tokens)
}

/// `helpers.cpp: build_blending_indices`: for `i = 0..size`, pick the dataset `d`
/// maximizing `weights[d]·max(i, 1) − count[d]` (strictly greater replaces, so the first
/// dataset wins ties), record `(d, count[d])` and increment `count[d]`. Deterministic, no RNG.
/// Weights are used as given (Megatron normalizes them to sum 1 beforehand). Megatron stores
/// the dataset index as `uint8`; `u16` here. With no weights the result is empty.
pub fn blend_indices(weights: &[f64], size: usize) -> (Vec<u16>, Vec<u64>) {
    if weights.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let mut counts = vec![0u64; weights.len()];
    let mut dataset_index = Vec::with_capacity(size);
    let mut dataset_sample_index = Vec::with_capacity(size);
    for i in 0..size {
        let x = (i as f64).max(1.0);
        let mut best = 0usize;
        let mut best_error = weights[0] * x - counts[0] as f64;
        for (d, &w) in weights.iter().enumerate().skip(1) {
            let error = w * x - counts[d] as f64;
            if error > best_error {
                best_error = error;
                best = d;
            }
        }
        dataset_index.push(best as u16);
        dataset_sample_index.push(counts[best]);
        counts[best] += 1;
    }
    (dataset_index, dataset_sample_index)
}

/// Samples each component of a blend is asked for (`_get_size_per_split_per_dataset`):
/// `ceil(ceil(size·w)·(1 + surplus))`, surplus 0.005 by default in Megatron.
pub fn blend_component_sizes(weights: &[f64], size: usize, surplus: f64) -> Vec<u64> {
    weights
        .iter()
        .map(|w| ((size as f64 * w).ceil() * (1.0 + surplus)).ceil() as u64)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZES: [i32; 6] = [5, 3, 7, 2, 9, 4];

    fn sizes_sum(docs: &[u32]) -> u64 {
        docs.iter().map(|&d| SIZES[d as usize] as u64).sum()
    }

    /// Token `t` of document `d` is `d·100 + t`, so a sample reveals where its tokens came from.
    fn reader(doc: u32, offset: usize, len: usize) -> Vec<u32> {
        (offset..offset + len)
            .map(|t| doc * 100 + t as u32)
            .collect()
    }

    #[test]
    fn numpy_permutation_matches_numpy() {
        // numpy 2.4.6: np.random.RandomState(1234).permutation(10), (0) of 20, (2**32-1) of 7.
        assert_eq!(
            NumpyRandomState::new(1234).permutation(10),
            vec![7, 2, 9, 1, 0, 8, 4, 5, 6, 3]
        );
        assert_eq!(
            NumpyRandomState::new(0).permutation(20),
            vec![
                18, 1, 19, 8, 10, 17, 6, 13, 4, 2, 5, 14, 9, 7, 16, 11, 3, 0, 15, 12
            ]
        );
        assert_eq!(
            NumpyRandomState::new(u32::MAX).permutation(7),
            vec![1, 5, 0, 6, 4, 2, 3]
        );
    }

    #[test]
    fn gpt_indices_match_megatron_logic_under_numpy() {
        // Expected values printed by a Python transcription of Megatron's gpt_dataset.py and
        // helpers.cpp run with numpy 2.4.6 (the script was not kept in the repository).
        let all: Vec<u32> = (0..6).collect();
        let got = build_gpt_indices(&SIZES, &all, 4, Some(5), 1234, true).unwrap();
        assert_eq!(got.num_epochs, 1);
        assert!(!got.separate_final_epoch);
        assert_eq!(got.document_index, vec![2, 1, 5, 0, 4, 3]);
        assert_eq!(
            got.sample_index,
            vec![
                (0, 0),
                (0, 4),
                (1, 1),
                (2, 2),
                (3, 2),
                (4, 1),
                (4, 5),
                (5, 0)
            ]
        );
        assert_eq!(got.shuffle_index, vec![5, 0, 3, 4, 2, 6, 1]);

        let got = build_gpt_indices(&SIZES, &all, 4, Some(20), 1234, true).unwrap();
        assert_eq!(got.num_epochs, 3);
        assert!(!got.separate_final_epoch);
        assert_eq!(
            got.document_index,
            vec![5, 3, 5, 4, 1, 2, 0, 2, 4, 1, 1, 3, 2, 4, 0, 5, 0, 3]
        );
        assert_eq!(
            got.shuffle_index,
            vec![
                8, 17, 21, 1, 4, 20, 19, 13, 14, 9, 0, 11, 7, 3, 10, 6, 2, 5, 12, 16, 18, 15
            ]
        );
        assert_eq!(got.sample_index.len(), 23);
        assert_eq!(got.sample_index[14], (11, 0));

        let got = build_gpt_indices(&SIZES, &[1, 2, 4], 3, Some(12), 7, true).unwrap();
        assert_eq!(got.num_epochs, 2);
        assert_eq!(got.document_index, vec![1, 4, 1, 4, 2, 2]);
        assert_eq!(
            got.sample_index,
            vec![
                (0, 0),
                (1, 0),
                (1, 3),
                (1, 6),
                (2, 0),
                (3, 0),
                (3, 3),
                (3, 6),
                (4, 0),
                (4, 3),
                (4, 6),
                (5, 2),
                (5, 5)
            ]
        );
        assert_eq!(
            got.shuffle_index,
            vec![1, 2, 5, 3, 0, 4, 6, 11, 10, 9, 8, 7]
        );
    }

    #[test]
    fn separate_final_epoch_matches_megatron_logic_under_numpy() {
        let all: Vec<u32> = (0..6).collect();
        let got = build_gpt_indices(&SIZES, &all, 4, Some(9), 3, true).unwrap();
        assert_eq!(got.num_epochs, 2);
        assert!(got.separate_final_epoch);
        assert_eq!(got.document_index, vec![3, 5, 4, 1, 0, 2, 5, 4, 1, 2, 3, 0]);
        // Each half of the document index is one whole epoch.
        let mut first = got.document_index[..6].to_vec();
        first.sort();
        assert_eq!(first, all);
        assert_eq!(
            got.shuffle_index,
            vec![6, 1, 3, 4, 0, 5, 2, 10, 12, 11, 8, 9, 7, 13]
        );
        // The first 7 (= samples without the last epoch) are a permutation of 0..7.
        assert!(got.shuffle_index[..7].iter().all(|&s| s < 7));
    }

    #[test]
    fn num_epochs_is_smallest_covering_count() {
        // 30 tokens per epoch, S = 4: 7 samples need 29 tokens (1 epoch), 8 need 33 (2).
        assert_eq!(num_epochs(30, Some(7), 4, true).unwrap(), 1);
        assert_eq!(num_epochs(30, Some(8), 4, true).unwrap(), 2);
        assert_eq!(num_epochs(30, Some(14), 4, true).unwrap(), 2);
        assert_eq!(num_epochs(30, Some(15), 4, true).unwrap(), 3);
        assert_eq!(num_epochs(30, None, 4, true).unwrap(), 1);
        assert!(num_epochs(0, Some(1), 4, true).is_err());
        // Final epoch of 2 samples (< int(0.8·7) = 5) is separate; of 5 it is not.
        assert!(separate_final_epoch(30, 9, 4, 2, true));
        assert!(!separate_final_epoch(30, 12, 4, 2, true));
        assert!(!separate_final_epoch(30, 7, 4, 1, true));
    }

    #[test]
    fn samples_have_seq_length_plus_one_tokens_and_overlap_by_one() {
        for (seq_length, epochs, seed) in [(4, 1, 1), (3, 3, 2), (8, 2, 9), (1, 1, 5)] {
            let doc_index = build_document_index(SIZES.len(), epochs, seed, false);
            let tpe = sizes_sum(&(0..6).collect::<Vec<_>>());
            let samples =
                build_sample_index(&SIZES, &doc_index, seq_length, epochs, tpe, true).unwrap();
            let n = samples.len() - 1;
            assert_eq!(n, ((epochs as u64 * tpe - 1) / seq_length as u64) as usize);
            let identity: Vec<usize> = (0..n).collect();
            let mut previous: Option<Vec<u32>> = None;
            for i in 0..n {
                let t = sample_tokens(
                    &SIZES,
                    &doc_index,
                    &samples,
                    &identity,
                    i,
                    seq_length,
                    true,
                    u32::MAX,
                    reader,
                )
                .unwrap();
                assert_eq!(t.len(), seq_length + 1);
                assert!(!t.contains(&u32::MAX), "a full sample is never padded");
                if let Some(p) = previous {
                    assert_eq!(p.last(), t.first(), "samples overlap by exactly one token");
                }
                previous = Some(t);
            }
        }
    }

    #[test]
    fn every_token_of_the_epochs_is_used_once() {
        // The stream of samples, overlap removed, is the concatenated documents in
        // document-index order, minus only the tail that does not fill a sample.
        let seq_length = 4;
        let epochs = 2;
        let doc_index = build_document_index(SIZES.len(), epochs, 42, false);
        let tpe = sizes_sum(&(0..6).collect::<Vec<_>>());
        let samples =
            build_sample_index(&SIZES, &doc_index, seq_length, epochs, tpe, true).unwrap();
        let n = samples.len() - 1;
        let identity: Vec<usize> = (0..n).collect();
        let mut stream = Vec::new();
        for i in 0..n {
            let t = sample_tokens(
                &SIZES, &doc_index, &samples, &identity, i, seq_length, true, 0, reader,
            )
            .unwrap();
            let skip = usize::from(i > 0);
            stream.extend_from_slice(&t[skip..]);
        }
        let all: Vec<u32> = doc_index
            .iter()
            .flat_map(|&d| reader(d, 0, SIZES[d as usize] as usize))
            .collect();
        assert_eq!(stream.len(), n * seq_length + 1);
        assert_eq!(stream[..], all[..stream.len()]);
        assert!(all.len() - stream.len() < seq_length);
    }

    #[test]
    fn tokens_and_labels_shift_by_one() {
        let doc_index = build_document_index(SIZES.len(), 1, 0, false);
        let samples = build_sample_index(&SIZES, &doc_index, 4, 1, 30, true).unwrap();
        let shuffle = build_shuffle_index(samples.len() - 1, samples.len() - 1, 0);
        let t = sample_tokens(
            &SIZES, &doc_index, &samples, &shuffle, 0, 4, true, 0, reader,
        )
        .unwrap();
        let (tokens, labels) = (&t[..4], &t[1..]);
        assert_eq!(tokens[1..], labels[..3]);
    }

    #[test]
    fn document_index_repeats_documents_per_epoch() {
        let index = build_document_index(5, 3, 11, false);
        let mut sorted = index.clone();
        sorted.sort();
        let expected: Vec<u32> = (0..5).flat_map(|d| [d, d, d]).collect();
        assert_eq!(sorted, expected);
        let separate = build_document_index(5, 3, 11, true);
        let mut last = separate[10..].to_vec();
        last.sort();
        assert_eq!(last, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn same_seed_same_indices_different_seed_different_order() {
        let a = build_document_index(50, 2, 7, false);
        assert_eq!(a, build_document_index(50, 2, 7, false));
        assert_ne!(a, build_document_index(50, 2, 8, false));
        let s = build_shuffle_index(100, 100, 7);
        assert_eq!(s, build_shuffle_index(100, 100, 7));
        assert_ne!(s, build_shuffle_index(100, 100, 8));
        let mut sorted = s.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        // Separate tail: [0, 60) then [60, 100).
        let split = build_shuffle_index(60, 100, 7);
        assert!(split[..60].iter().all(|&x| x < 60));
        assert!(split[60..].iter().all(|&x| x >= 60));
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        assert!(build_sample_index(&SIZES, &[0, 9], 4, 1, 12, true).is_err());
        assert!(build_sample_index(&SIZES, &[0, 1], 4, 1, 100, true).is_err());
        assert!(build_sample_index(&SIZES, &[0], 0, 1, 5, true).is_err());
        assert!(build_gpt_indices(&SIZES, &[7], 4, Some(1), 0, true).is_err());
        let samples = build_sample_index(&SIZES, &[0], 4, 1, 5, true).unwrap();
        assert!(sample_tokens(&SIZES, &[0], &samples, &[0], 3, 4, true, 0, reader).is_err());
    }

    #[test]
    fn blending_matches_python_greedy_rule() {
        // Printed by a direct Python transcription of build_blending_indices (not kept).
        let (d, s) = blend_indices(&[0.5, 0.3, 0.2], 12);
        assert_eq!(d, vec![0, 1, 2, 0, 1, 0, 2, 0, 1, 0, 0, 1]);
        assert_eq!(s, vec![0, 0, 0, 1, 1, 2, 1, 3, 2, 4, 5, 3]);
        // First dataset wins ties only among equal errors: at i = 0 the 0.5 dataset leads.
        let (d, _) = blend_indices(&[0.25, 0.25, 0.5], 8);
        assert_eq!(d, vec![2, 0, 1, 2, 0, 2, 1, 2]);
        // Checksums over 2000 samples from the same script: Σ i·d_i and Σ s_i.
        let (d, s) = blend_indices(&[0.5, 0.3, 0.2], 2000);
        let weighted: u64 = d
            .iter()
            .enumerate()
            .map(|(i, &x)| i as u64 * x as u64)
            .sum();
        assert_eq!(weighted, 1_398_800);
        assert_eq!(s.iter().sum::<u64>(), 759_000);
    }

    #[test]
    fn blending_tracks_the_weights_at_every_prefix() {
        // The greedy rule targets w·max(i, 1) *before* sample i, so after n samples a count can
        // be off from w·n by more than one: the Python transcription finds 1.2 for
        // [0.7, 0.1, 0.1, 0.1] at n = 46, and at most 1.36 over 300 random blends of 2..8
        // datasets. The bound checked here is therefore "fewer than 2 samples".
        for weights in [
            vec![0.5, 0.3, 0.2],
            vec![0.7, 0.1, 0.1, 0.1],
            vec![1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0],
            vec![0.01, 0.99],
        ] {
            let (d, s) = blend_indices(&weights, 2000);
            let mut counts = vec![0u64; weights.len()];
            for (n, (&di, &si)) in d.iter().zip(&s).enumerate() {
                assert_eq!(si, counts[di as usize], "sample index counts per dataset");
                counts[di as usize] += 1;
                for (k, w) in weights.iter().enumerate() {
                    let ideal = w * (n + 1) as f64;
                    assert!(
                        (counts[k] as f64 - ideal).abs() < 2.0,
                        "prefix {} dataset {k}: {} vs {ideal}",
                        n + 1,
                        counts[k]
                    );
                }
            }
        }
        assert_eq!(blend_indices(&[], 5), (vec![], vec![]));
        assert_eq!(blend_component_sizes(&[0.5, 0.5], 100, 0.005), vec![51, 51]);
    }
}
