//! The output stage: detokenizing, stop strings, length and context limits, stream events.

use crate::model::Model;

use super::sequence::Sequence;
use super::{Event, FinishReason};

/// After a step appended a token to `s`: its text grows, and a stop token, stop string, the
/// length limit or a full context finishes it.
pub(crate) fn after_token(model: &Model, s: &mut Sequence) {
    let fed = s.fed_last();
    let delta = s.text.decoder.push(&model.tokenizer, fed);
    s.text.text.push_str(&delta);
    s.text.new_token = true;
    check_stop(model, s, fed, delta.len());
}

/// `new_bytes`: how much text this step appended. No stop string occurred in the text before
/// it, so a new occurrence must end in those bytes: only the tail is searched, which keeps long
/// outputs linear.
fn check_stop(model: &Model, s: &mut Sequence, fed: u32, new_bytes: usize) {
    let ctx = model.decoder.cfg.context_length;
    let text = &mut s.text.text;
    let longest = s.req.params.stop.iter().map(|st| st.len()).max().unwrap_or(0);
    let mut from = text.len().saturating_sub(new_bytes + longest.saturating_sub(1));
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    let tail = &text[from..];
    if model.tokenizer.stop_ids.contains(&fed) {
        s.finish = Some(FinishReason::Eos);
    } else if let Some(pos) = s.req.params.stop.iter().filter_map(|st| tail.find(st.as_str())).min().map(|p| from + p) {
        text.truncate(pos);
        s.finish = Some(FinishReason::StopString);
    } else if s.steps.len() >= s.req.params.max_new_tokens {
        s.finish = Some(FinishReason::Length);
    } else if s.target() + 1 >= ctx {
        s.finish = Some(FinishReason::ContextFull);
    }
}

/// Streams the text that can no longer turn into a stop string.
pub(crate) fn emit(events: &mut Vec<Event>, s: &mut Sequence) {
    if !std::mem::take(&mut s.text.new_token) {
        return;
    }
    let Some(last) = s.steps.last() else { return };
    let (id, index, token, logprob, top_logprobs) =
        (s.request, s.index, last.token, last.logprob, last.top_logprobs.clone());
    let t = &mut s.text;
    if s.finish.is_none() {
        let tail = t.text.get(t.emitted..).unwrap_or("");
        let mut hold = 0;
        for st in &s.req.params.stop {
            for l in (1..st.len().min(tail.len() + 1)).rev() {
                if tail.is_char_boundary(tail.len() - l) && st.starts_with(&tail[tail.len() - l..]) {
                    hold = hold.max(l);
                    break;
                }
            }
        }
        let safe = t.text.len() - hold;
        let text = t.text[t.emitted..safe].to_string();
        t.emitted = safe;
        events.push(Event::Token { id, index, token, text, logprob, top_logprobs });
    } else {
        if s.finish != Some(FinishReason::StopString) {
            let rest = t.decoder.finish();
            t.text.push_str(&rest);
        }
        let text = t.text.get(t.emitted.min(t.text.len())..).unwrap_or("").to_string();
        t.emitted = t.text.len();
        events.push(Event::Token { id, index, token, text, logprob, top_logprobs });
    }
}
