//! 6. One row, end to end, with counters

use super::*;
/// Everything [`process_row`] needs besides the template and the tokenizer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowConfig {
    pub fields: RowFields,
    /// Keep only records whose `used_in_field` names this (step 1); `None` keeps all.
    pub used_in_filter: Option<String>,
    pub used_in_field: String,
    pub max_doc_tokens: Option<usize>,
    pub chat: ChatOptions,
}

impl Default for RowConfig {
    fn default() -> Self {
        RowConfig {
            fields: RowFields::default(),
            used_in_filter: None,
            used_in_field: "used_in".to_string(),
            max_doc_tokens: None,
            chat: ChatOptions::default(),
        }
    }
}

/// Row and sequence counters, named as Nemotron's shard processor names them: every dropped
/// row counts in `num_filtered`; validation drops also in `num_validation_errors`; bad
/// arguments, malformed rows and template failures/mismatches also in `num_errors`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ChatStats {
    pub num_input_rows: u64,
    pub num_output_sequences: u64,
    pub num_filtered: u64,
    pub num_validation_errors: u64,
    pub num_truncated: u64,
    pub num_errors: u64,
}

impl ChatStats {
    pub fn record_drop(&mut self, reason: &DropReason) {
        self.num_filtered += 1;
        match reason {
            DropReason::NotUsedIn | DropReason::NoMessages => {}
            DropReason::ToolCallWithoutToolsHeader => self.num_validation_errors += 1,
            DropReason::InvalidRow(_)
            | DropReason::BadToolArguments(_)
            | DropReason::RenderMismatch { .. }
            | DropReason::Render(_) => self.num_errors += 1,
        }
    }
}

/// Steps 1–7 for one JSONL line: the token ids and loss masks of every sequence it yields
/// (sequences without tokens are skipped), or the reason it yields none. `stats` counts the
/// row, its drop or its sequences and truncations.
pub fn process_row(
    template: &ChatTemplate,
    line: &str,
    cfg: &RowConfig,
    encode: impl Fn(&str) -> Vec<u32>,
    stats: &mut ChatStats,
) -> Result<Vec<TokenizedSequence>, DropReason> {
    stats.num_input_rows += 1;
    let result = row_sequences(template, line, cfg, &encode, stats);
    if let Err(reason) = &result {
        stats.record_drop(reason);
    }
    result
}

/// What [`process_row`] counts for a line that is not text (invalid UTF-8, said by `why`):
/// an input row dropped as invalid. Returns the reason.
pub fn unreadable_row(why: &str, stats: &mut ChatStats) -> DropReason {
    stats.num_input_rows += 1;
    let reason = DropReason::InvalidRow(why.to_string());
    stats.record_drop(&reason);
    reason
}

fn row_sequences(
    template: &ChatTemplate,
    line: &str,
    cfg: &RowConfig,
    encode: &impl Fn(&str) -> Vec<u32>,
    stats: &mut ChatStats,
) -> Result<Vec<TokenizedSequence>, DropReason> {
    let record = Json::parse(line).map_err(|e| DropReason::InvalidRow(e.message))?;
    if let Some(filter) = &cfg.used_in_filter
        && !matches_used_in(record.get(&cfg.used_in_field), filter)
    {
        return Err(DropReason::NotUsedIn);
    }
    let conv = Conversation::from_record(&record, &cfg.fields)?;
    let mut out = Vec::new();
    for chunks in role_chunks(template, &conv, &cfg.chat)? {
        let (mut ids, mut mask) = tokenize_chunks(&chunks, encode, None);
        if ids.is_empty() {
            continue;
        }
        if let Some(max) = cfg.max_doc_tokens
            && ids.len() > max
        {
            ids.truncate(max);
            mask.truncate(max);
            stats.num_truncated += 1;
        }
        stats.num_output_sequences += 1;
        out.push((ids, mask));
    }
    Ok(out)
}
