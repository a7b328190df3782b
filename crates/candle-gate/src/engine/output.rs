//! The output stage: detokenizing, stop strings, length and context limits, stream events, and
//! each finished request's output (its choices gathered, fingerprinted).

use std::collections::{HashMap, HashSet};

use crate::model::{fingerprint, Model};

use super::sequence::Sequence;
use super::{Choice, Event, FinishReason, Output, RequestId};

/// After a step appended a token to `s`: its text grows, and a stop token, stop string, the
/// length limit or a full context finishes it.
pub(crate) fn after_token(model: &Model, s: &mut Sequence) {
    let fed = s.fed_last();
    let delta = s.text.decoder.push(&model.tokenizer, fed);
    s.text.text.push_str(&delta);
    s.text.new_token = true;
    check_stop(&model.tokenizer.stop_ids, model.decoder.cfg.context_length, s, fed, delta.len());
}

/// `new_bytes`: how much text this step appended. No stop string occurred in the text before
/// it, so a new occurrence must end in those bytes: only the tail is searched, which keeps long
/// outputs linear.
fn check_stop(stop_ids: &HashSet<u32>, ctx: usize, s: &mut Sequence, fed: u32, new_bytes: usize) {
    let text = &mut s.text.text;
    let longest = s.req.params.stop.iter().map(|st| st.len()).max().unwrap_or(0);
    let mut from = text.len().saturating_sub(new_bytes + longest.saturating_sub(1));
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    let tail = &text[from..];
    if stop_ids.contains(&fed) {
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

/// What besides the tokens decides a result's bits, as its fingerprint covers them: the model
/// file, the kernel policy and K/V storage, the gate, the host and build.
pub(crate) struct Stack {
    pub model_sha: String,
    pub kernels: String,
    pub gate: String,
    pub host: String,
}

impl Stack {
    pub fn fingerprint(&self, tokens: &[u32]) -> String {
        fingerprint(&self.model_sha, &self.kernels, &self.gate, &self.host, tokens)
    }
    /// The same for every result of the stack (the server's `system_fingerprint`).
    pub fn system_fingerprint(&self) -> String {
        crate::model::system_fingerprint(&self.model_sha, &self.kernels, &self.gate, &self.host)
    }
}

/// Requests from submission to output: their stream events, the choices finished so far of
/// those still running, and the finished outputs not yet taken.
#[derive(Default)]
pub(crate) struct Outputs {
    pub events: Vec<Event>,
    pending: HashMap<RequestId, Pending>,
    finished: HashMap<RequestId, Output>,
}

/// A request whose choices are not all finished.
struct Pending {
    prompt_tokens: Vec<u32>,
    seed: u64,
    choices: Vec<Option<Choice>>,
}

impl Outputs {
    /// A submitted request of `n` choices, whose draws are keyed by `seed`.
    pub fn expect(&mut self, id: RequestId, prompt_tokens: Vec<u32>, seed: u64, n: usize) {
        self.pending.insert(id, Pending { prompt_tokens, seed, choices: vec![None; n] });
    }
    pub fn is_finished(&self, id: RequestId) -> bool {
        self.finished.contains_key(&id)
    }
    pub fn take(&mut self, id: RequestId) -> Option<Output> {
        self.finished.remove(&id)
    }

    /// Streams `s`'s new text, if a token arrived since the last event.
    pub fn emit(&mut self, s: &mut Sequence) {
        emit(&mut self.events, s)
    }

    /// `s` has left the engine: its choice is done, and its request's output when every choice is.
    pub fn retire(&mut self, s: Sequence, stack: &Stack) {
        let reason = s.finish.unwrap_or(FinishReason::Cancelled);
        let token_ids = s.output();
        let fp = stack.fingerprint(&token_ids);
        let steps = &s.steps;
        let choice = Choice {
            index: s.index,
            token_ids,
            margins: steps.iter().map(|r| r.margin).collect(),
            reference_margins: steps.iter().map(|r| r.reference_margin).collect(),
            rechecked: steps.iter().map(|r| r.rechecked).collect(),
            corrected: steps.iter().map(|r| r.corrected).collect(),
            logit_hashes: steps.iter().filter_map(|r| r.logit_hash).collect(),
            logprobs: steps.iter().filter_map(|r| r.logprob).collect(),
            top_logprobs: match s.req.params.top_logprobs {
                0 => Vec::new(),
                _ => steps.iter().map(|r| r.top_logprobs.clone()).collect(),
            },
            finish_reason: reason,
            fingerprint: fp,
            gate: s.gate_stats(),
            draft_tokens: s.speculation.draft_tokens,
            accepted_tokens: s.speculation.accepted_tokens,
            error: s.error.map(|e| e.to_string()),
            text: s.text.text,
        };
        let Some(p) = self.pending.get_mut(&s.request) else { return };
        // A request that ends before its prefill forked it ends every choice the same way.
        let unforked = s.index == 0 && steps.is_empty();
        for (index, slot) in p.choices.iter_mut().enumerate() {
            if index == s.index as usize || (unforked && slot.is_none()) {
                *slot = Some(Choice { index: index as u32, ..choice.clone() });
                let speculation = s.speculation;
                self.events.push(Event::Finished { id: s.request, index: index as u32, reason, speculation });
            }
        }
        if p.choices.iter().all(Option::is_some) {
            let p = self.pending.remove(&s.request).unwrap();
            let output = Output {
                id: s.request,
                prompt_tokens: p.prompt_tokens,
                cached_tokens: s.cached_tokens.unwrap_or(0),
                seed: p.seed,
                choices: p.choices.into_iter().map(Option::unwrap).collect(),
            };
            self.finished.insert(s.request, output);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sequence::{SeqId, StepRecord};
    use crate::engine::Request;
    use crate::sampling::SamplingParams;

    fn stack() -> Stack {
        Stack { model_sha: "sha".into(), kernels: "mode=invariant".into(), gate: "off".into(), host: "x".into() }
    }
    fn seq(index: u32, tokens: &[u32], params: SamplingParams) -> Sequence {
        let mut s = Sequence::new(SeqId(index as u64), 1, Request::new(vec![5, 6], params), 9);
        s.index = index;
        s.steps.extend(tokens.iter().map(|&token| StepRecord::plain(token, false)));
        s
    }

    #[test]
    fn an_output_waits_for_every_choice_and_keeps_them_in_index_order() {
        let mut out = Outputs::default();
        let params = SamplingParams { n: 2, ..SamplingParams::greedy(4) };
        out.expect(1, vec![5, 6], 9, 2);
        let mut second = seq(1, &[3, 4], params.clone());
        second.finish = Some(FinishReason::Length);
        out.retire(second, &stack());
        assert!(!out.is_finished(1));
        out.retire(seq(0, &[3], params), &stack());
        let o = out.take(1).unwrap();
        assert_eq!((o.seed, o.prompt_tokens.as_slice()), (9, &[5, 6][..]));
        let choices: Vec<(u32, Vec<u32>, FinishReason)> =
            o.choices.iter().map(|c| (c.index, c.token_ids.clone(), c.finish_reason)).collect();
        assert_eq!(choices, [(0, vec![3], FinishReason::Cancelled), (1, vec![3, 4], FinishReason::Length)]);
        assert_eq!(o.choices[1].fingerprint, stack().fingerprint(&[3, 4]));
        assert_ne!(o.choices[0].fingerprint, o.choices[1].fingerprint);
        let ends = out.events.iter().filter(|e| matches!(e, Event::Finished { .. })).count();
        assert_eq!(ends, 2);
        assert!(out.take(1).is_none(), "taken once");
    }

    #[test]
    fn a_request_that_ends_before_its_prefill_ends_every_choice() {
        let mut out = Outputs::default();
        out.expect(1, vec![5, 6], 9, 3);
        out.retire(seq(0, &[], SamplingParams { n: 3, ..SamplingParams::greedy(4) }), &stack());
        let o = out.take(1).unwrap();
        assert_eq!(o.choices.iter().map(|c| c.index).collect::<Vec<_>>(), [0, 1, 2]);
    }

    #[test]
    fn a_stream_holds_back_what_may_begin_a_stop_string() {
        let params = SamplingParams { stop: vec!["\n\n".into()], ..SamplingParams::greedy(8) };
        let mut s = seq(0, &[3], params);
        let mut events = Vec::new();
        let mut text_of = |s: &mut Sequence, text: &str| {
            s.text.text = text.into();
            s.text.new_token = true;
            emit(&mut events, s);
            match events.last() {
                Some(Event::Token { text, .. }) => text.clone(),
                _ => panic!("a token event"),
            }
        };
        assert_eq!(text_of(&mut s, "Hello\n"), "Hello");
        assert_eq!(text_of(&mut s, "Hello\nWorld"), "\nWorld");
    }

    #[test]
    fn a_stop_id_a_stop_string_the_length_and_the_context_each_finish() {
        let stop_ids: HashSet<u32> = [2].into();
        let mut s = seq(0, &[7], SamplingParams { stop: vec!["END".into()], ..SamplingParams::greedy(2) });
        check_stop(&stop_ids, 100, &mut s, 2, 0);
        assert_eq!(s.finish, Some(FinishReason::Eos));
        s.finish = None;
        s.text.text = "abcEN".into();
        check_stop(&stop_ids, 100, &mut s, 7, 2);
        assert_eq!(s.finish, None);
        s.text.text = "abcENDx".into();
        check_stop(&stop_ids, 100, &mut s, 7, 2);
        assert_eq!((s.finish, s.text.text.as_str()), (Some(FinishReason::StopString), "abc"));
        s.finish = None;
        s.steps.push(s.steps[0].clone());
        check_stop(&stop_ids, 100, &mut s, 7, 0);
        assert_eq!(s.finish, Some(FinishReason::Length));
        s.finish = None;
        s.req.params.max_new_tokens = 8;
        check_stop(&stop_ids, 4, &mut s, 7, 0);
        assert_eq!(s.finish, Some(FinishReason::ContextFull), "the prompt and two tokens fill 4 positions");
    }
}
