//! Requests whose grammar is compiling: a constrained request enters the scheduler once its
//! matcher is open. The constraint plugin compiles on threads of its own where it can
//! ([`Constrainer::start_open`], the engine's constraint lanes): a grammar may take up to the
//! server's compile limit (200 ms), and compiled on the engine thread it would keep the device
//! waiting for that long with every other request.
//!
//! The engine starts compilations where they cannot delay a step's masks (after the step
//! ahead's masks went out, or with nothing on the device) and takes the matchers in before it
//! schedules: [`Openings::pump`].

use std::sync::Arc;

use super::api::{EventSender, GenerateRequest, Grammar};
use crate::cache::BlockHash;
use crate::policy::{Constrainer, ConstraintError, Opening};

/// A request waiting for its matcher, with what `Engine::add` prepared for its admission.
pub(super) struct Pending {
    pub req: GenerateRequest,
    pub events: EventSender,
    pub min_ban: Vec<u32>,
    pub hashes: Option<Arc<[BlockHash]>>,
    pub grammar: Grammar,
    /// Handed to the constraint plugin.
    started: bool,
    /// Cancelled while compiling: its matcher is closed when it comes.
    pub cancelled: bool,
}

impl Pending {
    pub fn new(
        req: GenerateRequest,
        events: EventSender,
        min_ban: Vec<u32>,
        hashes: Option<Arc<[BlockHash]>>,
        grammar: Grammar,
    ) -> Self {
        Self {
            req,
            events,
            min_ban,
            hashes,
            grammar,
            started: false,
            cancelled: false,
        }
    }
}

/// The requests waiting for their matchers, in arrival order.
#[derive(Default)]
pub(super) struct Openings {
    pending: Vec<Pending>,
    /// Scratch for the plugin's answers.
    done: Vec<(u64, Result<u32, ConstraintError>)>,
}

impl Openings {
    pub fn push(&mut self, p: Pending) {
        self.pending.push(p);
    }

    /// Requests waiting for their matchers (cancelled ones whose compilation runs included).
    pub fn len(&self) -> usize {
        self.pending.iter().filter(|p| !p.cancelled).count()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Ids of the requests still waiting (not cancelled).
    pub fn ids(&self) -> Vec<u64> {
        let live = self.pending.iter().filter(|p| !p.cancelled);
        live.map(|p| p.req.id).collect()
    }

    /// Marks request `id` cancelled and returns it to be told so (once): dropped at once if
    /// its compilation has not started, else kept until its matcher comes to be closed.
    pub fn cancel(&mut self, id: u64) -> Option<(GenerateRequest, EventSender)> {
        let i = (self.pending.iter()).position(|p| p.req.id == id && !p.cancelled)?;
        if !self.pending[i].started {
            let p = self.pending.remove(i);
            return Some((p.req, p.events));
        }
        let p = &mut self.pending[i];
        p.cancelled = true;
        Some((p.req.clone(), p.events.clone()))
    }

    /// Takes in the compilations that ended and starts those the plugin has room for, in
    /// arrival order (`start`: false only takes in). Returns each request whose compilation
    /// ended with its matcher or why not; the cancelled ones' matchers are closed here.
    pub fn pump(
        &mut self,
        c: &mut dyn Constrainer,
        start: bool,
    ) -> Vec<(Pending, Result<u32, ConstraintError>)> {
        c.take_opened(&mut self.done);
        if start {
            for p in self.pending.iter_mut().filter(|p| !p.started) {
                match c.start_open(p.req.id, &p.grammar.kind, &p.grammar.text) {
                    Opening::Done(r) => self.done.push((p.req.id, r)),
                    Opening::Started => {}
                    Opening::Busy => break,
                }
                p.started = true;
            }
        }
        let mut out = Vec::with_capacity(self.done.len());
        for (id, r) in self.done.drain(..) {
            let Some(i) = self.pending.iter().position(|p| p.req.id == id) else {
                // Not ours (never expected): a matcher nobody will use.
                if let Ok(m) = r {
                    c.close(m);
                }
                continue;
            };
            let p = self.pending.remove(i);
            if p.cancelled {
                if let Ok(m) = r {
                    c.close(m);
                }
                continue;
            }
            out.push((p, r));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{ConstraintLanes, MaskJob};

    /// Matchers numbered from 1; "bad" is refused; each matcher's mask is its number.
    #[derive(Default)]
    struct Numbered {
        next: u32,
        closed: Vec<u32>,
    }

    impl Constrainer for Numbered {
        fn open(&mut self, _kind: &str, grammar: &str) -> Result<u32, ConstraintError> {
            if grammar == "panic" {
                panic!("a plugin bug");
            }
            if grammar == "bad" {
                return Err(ConstraintError::Grammar("bad grammar".into()));
            }
            // A grammar that takes a while to compile.
            std::thread::sleep(std::time::Duration::from_millis(2));
            self.next += 1;
            Ok(self.next)
        }

        fn next(&mut self, matcher: u32, _tokens: &[u32], mask: &mut [u32]) -> Result<(), String> {
            mask.fill(matcher);
            Ok(())
        }

        fn rollback(&mut self, _matcher: u32, _count: u32) -> Result<(), String> {
            Ok(())
        }

        fn close(&mut self, matcher: u32) {
            self.closed.push(matcher);
        }
    }

    fn pending(id: u64, grammar: &str) -> Pending {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        Pending::new(
            GenerateRequest::greedy(id, vec![1, 2], 4),
            tx.into(),
            Vec::new(),
            None,
            Grammar {
                kind: "lark".into(),
                text: grammar.into(),
            },
        )
    }

    /// Pumps until every request has its answer, the ids in the order they came back.
    fn drain(
        o: &mut Openings,
        c: &mut dyn Constrainer,
    ) -> Vec<(u64, Result<u32, ConstraintError>)> {
        let mut got = Vec::new();
        for _ in 0..2000 {
            got.extend(o.pump(c, true).into_iter().map(|(p, r)| (p.req.id, r)));
            if o.is_empty() {
                return got;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        panic!("compilations never ended: {} left", o.len());
    }

    #[test]
    fn a_plain_constrainer_compiles_on_the_calling_thread() {
        let mut c = Numbered::default();
        let mut o = Openings::default();
        o.push(pending(7, "a"));
        o.push(pending(8, "bad"));
        let got = o.pump(&mut c, true);
        assert!(o.is_empty());
        let got: Vec<_> = got.into_iter().map(|(p, r)| (p.req.id, r)).collect();
        assert_eq!(got[0], (7, Ok(1)));
        assert_eq!(
            got[1],
            (8, Err(ConstraintError::Grammar("bad grammar".into())))
        );
    }

    #[test]
    fn lanes_compile_elsewhere_one_grammar_a_lane_and_every_request_gets_its_matcher() {
        let lanes: Vec<Box<dyn Constrainer>> = (0..2)
            .map(|_| Box::new(Numbered::default()) as Box<dyn Constrainer>)
            .collect();
        let mut c = ConstraintLanes::new(lanes);
        let mut o = Openings::default();
        for id in 0..6 {
            o.push(pending(id, if id == 3 { "bad" } else { "g" }));
        }
        // Two lanes: two compilations start, the rest wait their turn.
        assert!(
            o.pump(&mut c, true).is_empty(),
            "nothing compiles on this thread"
        );
        assert_eq!(c.opening(), 2);
        assert_eq!(o.len(), 6);
        let mut got = drain(&mut o, &mut c);
        got.sort_by_key(|(id, _)| *id);
        assert_eq!(got.len(), 6);
        assert_eq!(
            got[3].1,
            Err(ConstraintError::Grammar("bad grammar".into()))
        );
        let matchers: Vec<u32> = got.iter().filter_map(|(_, r)| r.clone().ok()).collect();
        assert_eq!(matchers.len(), 5);
        // Each matcher answers from the lane that compiled it: distinct outer ids, each
        // answering with its lane's own number.
        let mut masks = vec![0u32; 5];
        let mut jobs: Vec<MaskJob<'_>> = masks
            .chunks_mut(1)
            .zip(&matchers)
            .map(|(mask, &matcher)| MaskJob {
                matcher,
                tokens: &[],
                mask,
                result: Ok(()),
            })
            .collect();
        c.next_batch(&mut jobs);
        assert!(jobs.iter().all(|j| j.result.is_ok()));
        drop(jobs);
        let mut sorted = matchers.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 5, "outer ids are distinct: {matchers:?}");
        // Lane-local numbers 1..=3 and 1..=2 (or 1..=2 and 1..=3; the bad one opened none).
        let mut local = masks.clone();
        local.sort_unstable();
        assert_eq!(local, vec![1, 1, 2, 2, 3], "{masks:?}");
        assert_eq!(c.opening(), 0);
    }

    #[test]
    fn a_compilation_that_panics_fails_its_request_and_the_lane_goes_on() {
        let lanes: Vec<Box<dyn Constrainer>> = vec![Box::new(Numbered::default())];
        let mut c = ConstraintLanes::new(lanes);
        let mut o = Openings::default();
        o.push(pending(1, "panic"));
        o.push(pending(2, "g"));
        let mut got = drain(&mut o, &mut c);
        got.sort_by_key(|(id, _)| *id);
        assert!(
            matches!(&got[0], (1, Err(ConstraintError::Failed(m))) if m.contains("compiling")),
            "{got:?}"
        );
        assert_eq!(got[1], (2, Ok(0)));
    }

    #[test]
    fn a_request_cancelled_while_compiling_has_its_matcher_closed() {
        let lanes: Vec<Box<dyn Constrainer>> = vec![Box::new(Numbered::default())];
        let mut c = ConstraintLanes::new(lanes);
        let mut o = Openings::default();
        o.push(pending(1, "g"));
        o.push(pending(2, "g"));
        assert!(o.pump(&mut c, true).is_empty());
        // 1 compiles; 2 has not started and leaves at once; 1 is kept until its matcher comes.
        assert!(o.cancel(2).is_some());
        assert!(o.cancel(1).is_some());
        assert!(o.cancel(1).is_none(), "told once");
        assert_eq!(o.len(), 0);
        assert!(!o.is_empty());
        assert!(drain(&mut o, &mut c).is_empty());
        // The matcher was closed: the lane's next compilation reuses outer id 0 and the next
        // is never answered for a closed one.
        let mut mask = [0u32; 1];
        assert_eq!(c.next(0, &[], &mut mask), Err("no matcher 0".to_string()));
    }
}
