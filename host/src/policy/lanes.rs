//! [`ConstraintLanes`]: one engine's constraints spread over several constrainers (lanes), each
//! its own plugin instance, so that a step's masks are computed on several threads at once and
//! grammars compile off the engine thread.
//!
//! A step's masks are due while its forward pass runs (the tokens they follow were sampled by
//! the step before): 64 masks of a 2.7 KB tool-call schema took 4–12 ms on one thread of the
//! build machine (`cargo bench --bench constraint`), as long as an 8B model's forward pass, and
//! the device waited for them. A matcher lives in the lane that opened it (the one with the
//! fewest open); a batch runs each lane's masks on its own thread of a small pool, the first
//! lane's on the calling thread.
//!
//! A grammar compiles in a lane too (up to `agent::MAX_COMPILE`, 200 ms, for a grammar the
//! server let through), and on the engine thread the device would wait for it: [`start_open`]
//! compiles on a thread of the lanes' own, at most one grammar a lane at a time so that a
//! step's masks never wait for more than one compilation in their lane, and the engine takes
//! the matchers from [`take_opened`] when it next schedules.
//!
//! [`start_open`]: Constrainer::start_open
//! [`take_opened`]: Constrainer::take_opened

use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Constrainer, ConstraintError, MaskJob, Opening};
use crate::slab::Slab;

/// A lane: one constrainer, locked by whichever thread computes with it.
type Lane = Arc<Mutex<Box<dyn Constrainer>>>;

/// A compilation's answer: the response's tag, the lane, the matcher there or why not.
type Compiled = (u64, usize, Result<u32, ConstraintError>);

pub struct ConstraintLanes {
    lanes: Vec<Lane>,
    /// Matchers open in each lane, those compiling included.
    open: Vec<u32>,
    /// A grammar compiles in the lane.
    compiling: Vec<bool>,
    /// By outer matcher id: its lane and its id there.
    ids: Slab<(u32, u32)>,
    /// Threads for the lanes' masks after the first (`None` with one lane, or when the pool
    /// could not start: the lanes then run one after another).
    pool: Option<rayon::ThreadPool>,
    /// Threads for compilations, one a lane (`None` when they could not start: grammars then
    /// compile on the calling thread).
    compilers: Option<rayon::ThreadPool>,
    done_tx: mpsc::Sender<Compiled>,
    done_rx: mpsc::Receiver<Compiled>,
}

fn lock(lane: &Lane) -> MutexGuard<'_, Box<dyn Constrainer>> {
    // A lane whose thread panicked holds matchers of other responses: kept in use.
    lane.lock().unwrap_or_else(|p| p.into_inner())
}

fn pool(threads: usize, name: &'static str) -> Option<rayon::ThreadPool> {
    (threads > 0)
        .then(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(move |i| format!("{name}-{i}"))
                .build()
        })
        .and_then(|p| {
            p.map_err(|e| tracing::warn!(error = %e, threads = name, "no threads for the constraint lanes; their work runs on the engine thread"))
                .ok()
        })
}

impl ConstraintLanes {
    /// `lanes`: at least one constrainer, each with its own state (plugin instance).
    pub fn new(lanes: Vec<Box<dyn Constrainer>>) -> Self {
        assert!(!lanes.is_empty(), "ConstraintLanes needs a lane");
        let n = lanes.len();
        let (done_tx, done_rx) = mpsc::channel();
        Self {
            open: vec![0; n],
            compiling: vec![false; n],
            lanes: lanes.into_iter().map(|l| Arc::new(Mutex::new(l))).collect(),
            ids: Slab::new(),
            pool: pool(n - 1, "chimera-masks"),
            compilers: pool(n, "chimera-grammars"),
            done_tx,
            done_rx,
        }
    }

    fn route(&self, matcher: u32) -> Result<(usize, u32), String> {
        match self.ids.get(matcher) {
            Some(&(lane, id)) => Ok((lane as usize, id)),
            None => Err(format!("no matcher {matcher}")),
        }
    }

    /// The lane with the fewest matchers open, of those `free` allows.
    fn least_open(&self, free: impl Fn(usize) -> bool) -> Option<usize> {
        (0..self.lanes.len())
            .filter(|&l| free(l))
            .min_by_key(|&l| self.open[l])
    }

    /// Takes in a compilation's answer: the matcher gets its outer id.
    fn adopt(
        &mut self,
        lane: usize,
        r: Result<u32, ConstraintError>,
    ) -> Result<u32, ConstraintError> {
        match r {
            Ok(id) => Ok(self.ids.insert((lane as u32, id))),
            Err(e) => {
                self.open[lane] = self.open[lane].saturating_sub(1);
                Err(e)
            }
        }
    }
}

impl Constrainer for ConstraintLanes {
    fn open(&mut self, kind: &str, grammar: &str) -> Result<u32, ConstraintError> {
        let lane = self.least_open(|_| true).unwrap_or(0);
        self.open[lane] += 1;
        let r = lock(&self.lanes[lane]).open(kind, grammar);
        self.adopt(lane, r)
    }

    fn start_open(&mut self, tag: u64, kind: &str, grammar: &str) -> Opening {
        let Some(compilers) = &self.compilers else {
            return Opening::Done(self.open(kind, grammar));
        };
        let Some(lane) = self.least_open(|l| !self.compiling[l]) else {
            return Opening::Busy;
        };
        self.open[lane] += 1;
        self.compiling[lane] = true;
        let (worker, tx) = (self.lanes[lane].clone(), self.done_tx.clone());
        let (kind, grammar) = (kind.to_string(), grammar.to_string());
        compilers.spawn(move || {
            // A compilation that panics still answers: the request fails instead of waiting
            // for a matcher forever.
            let open = std::panic::AssertUnwindSafe(|| lock(&worker).open(&kind, &grammar));
            let r = std::panic::catch_unwind(open).unwrap_or_else(|_| {
                tracing::error!(lane, "the constraint plugin panicked compiling a grammar");
                Err(ConstraintError::Failed(
                    "the constraint plugin failed while compiling the grammar".into(),
                ))
            });
            // The lanes are gone when no one listens: their instances (and this matcher)
            // go with the last reference.
            let _ = tx.send((tag, lane, r));
        });
        Opening::Started
    }

    fn take_opened(&mut self, done: &mut Vec<(u64, Result<u32, ConstraintError>)>) {
        while let Ok((tag, lane, r)) = self.done_rx.try_recv() {
            self.compiling[lane] = false;
            let r = self.adopt(lane, r);
            done.push((tag, r));
        }
    }

    fn opening(&self) -> usize {
        self.compiling.iter().filter(|&&c| c).count()
    }

    fn next(&mut self, matcher: u32, tokens: &[u32], mask: &mut [u32]) -> Result<(), String> {
        let (lane, id) = self.route(matcher)?;
        lock(&self.lanes[lane]).next(id, tokens, mask)
    }

    fn next_batch(&mut self, jobs: &mut [MaskJob<'_>]) {
        let mut by_lane: Vec<Vec<&mut MaskJob<'_>>> =
            (0..self.lanes.len()).map(|_| Vec::new()).collect();
        for job in jobs.iter_mut() {
            match self.route(job.matcher) {
                Ok((lane, id)) => {
                    job.matcher = id;
                    by_lane[lane].push(job);
                }
                Err(e) => job.result = Err(e),
            }
        }
        let run = |lane: &Lane, list: Vec<&mut MaskJob<'_>>| {
            let mut c = lock(lane);
            for job in list {
                job.result = c.next(job.matcher, job.tokens, job.mask);
            }
        };
        let busy = by_lane.iter().filter(|l| !l.is_empty()).count();
        match &self.pool {
            Some(pool) if busy > 1 => {
                let mut pairs = self.lanes.iter().zip(by_lane);
                let first = pairs.next();
                pool.in_place_scope(|s| {
                    for (lane, list) in pairs {
                        if !list.is_empty() {
                            s.spawn(move |_| run(lane, list));
                        }
                    }
                    if let Some((lane, list)) = first {
                        run(lane, list);
                    }
                });
            }
            _ => {
                for (lane, list) in self.lanes.iter().zip(by_lane) {
                    if !list.is_empty() {
                        run(lane, list);
                    }
                }
            }
        }
    }

    fn rollback(&mut self, matcher: u32, count: u32) -> Result<(), String> {
        let (lane, id) = self.route(matcher)?;
        lock(&self.lanes[lane]).rollback(id, count)
    }

    fn close(&mut self, matcher: u32) {
        let Some((lane, id)) = self.ids.remove(matcher) else {
            return;
        };
        let lane = lane as usize;
        lock(&self.lanes[lane]).close(id);
        self.open[lane] = self.open[lane].saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// A constrainer whose mask for a matcher is its grammar's number plus the tokens it has
    /// consumed, in every word; `lane` tags its answers.
    struct Counting {
        lane: u32,
        matchers: HashMap<u32, (u32, u32)>,
        next_id: u32,
    }

    impl Constrainer for Counting {
        fn open(&mut self, _kind: &str, grammar: &str) -> Result<u32, ConstraintError> {
            let n = grammar
                .parse()
                .map_err(|_| ConstraintError::Grammar(format!("not a number: {grammar}")))?;
            self.next_id += 1;
            self.matchers.insert(self.next_id, (n, 0));
            Ok(self.next_id)
        }

        fn next(&mut self, matcher: u32, tokens: &[u32], mask: &mut [u32]) -> Result<(), String> {
            let (n, fed) = self.matchers.get_mut(&matcher).ok_or("unknown")?;
            *fed += tokens.len() as u32;
            if *n == 13 {
                return Err("thirteen".into());
            }
            mask.fill(*n * 1000 + *fed * 10 + self.lane);
            Ok(())
        }

        fn rollback(&mut self, matcher: u32, count: u32) -> Result<(), String> {
            let (_, fed) = self.matchers.get_mut(&matcher).ok_or("unknown")?;
            *fed = fed.checked_sub(count).ok_or("too far")?;
            Ok(())
        }

        fn close(&mut self, matcher: u32) {
            self.matchers.remove(&matcher);
        }
    }

    fn lanes(n: u32) -> ConstraintLanes {
        ConstraintLanes::new(
            (0..n)
                .map(|lane| {
                    Box::new(Counting {
                        lane,
                        matchers: HashMap::new(),
                        next_id: 100 * lane,
                    }) as Box<dyn Constrainer>
                })
                .collect(),
        )
    }

    #[test]
    fn a_batch_answers_each_matcher_from_its_own_lane() {
        let mut c = lanes(3);
        let ids: Vec<u32> = (1..=9)
            .map(|n| c.open("test", &n.to_string()).unwrap())
            .collect();
        assert_eq!(ids, (0..9).collect::<Vec<_>>());
        let tokens = [7u32, 8, 9];
        let mut masks = [0u32; 9 * 4];
        let mut jobs: Vec<MaskJob<'_>> = masks
            .chunks_mut(4)
            .zip(&ids)
            .map(|(mask, &matcher)| MaskJob {
                matcher,
                tokens: &tokens[..(matcher as usize % 3) + 1],
                mask,
                result: Ok(()),
            })
            .collect();
        c.next_batch(&mut jobs);
        assert!(jobs.iter().all(|j| j.result.is_ok()));
        drop(jobs);
        for (i, row) in masks.chunks(4).enumerate() {
            // Opened round-robin over the three lanes (each had the fewest open in turn).
            let want = (i as u32 + 1) * 1000 + (i as u32 % 3 + 1) * 10 + i as u32 % 3;
            assert_eq!(row, [want; 4], "matcher {i}");
        }
        // One at a time, the same routing.
        let mut mask = [0u32; 4];
        c.next(4, &[], &mut mask).unwrap();
        assert_eq!(mask, [5000 + 20 + 1; 4]);
        c.rollback(4, 2).unwrap();
        c.next(4, &[1], &mut mask).unwrap();
        assert_eq!(mask, [5000 + 10 + 1; 4]);
    }

    #[test]
    fn failures_stay_with_their_job_and_closed_ids_are_reused() {
        let mut c = lanes(2);
        let a = c.open("test", "12").unwrap();
        let b = c.open("test", "13").unwrap();
        assert!(matches!(
            c.open("test", "x"),
            Err(ConstraintError::Grammar(_))
        ));
        let mut masks = [0u32; 3 * 2];
        let mut rows = masks.chunks_mut(2);
        let mut jobs = vec![
            MaskJob {
                matcher: a,
                tokens: &[],
                mask: rows.next().unwrap(),
                result: Ok(()),
            },
            MaskJob {
                matcher: b,
                tokens: &[],
                mask: rows.next().unwrap(),
                result: Ok(()),
            },
            MaskJob {
                matcher: 77,
                tokens: &[],
                mask: rows.next().unwrap(),
                result: Ok(()),
            },
        ];
        c.next_batch(&mut jobs);
        assert!(jobs[0].result.is_ok());
        assert_eq!(jobs[1].result, Err("thirteen".to_string()));
        assert_eq!(jobs[2].result, Err("no matcher 77".to_string()));
        drop(jobs);
        c.close(a);
        c.close(a);
        assert_eq!(c.next(a, &[], &mut [0; 2]), Err(format!("no matcher {a}")));
        // The freed id comes back, in the lane with the fewest open (the one `a` left).
        assert_eq!(c.open("test", "3").unwrap(), a);
        let mut mask = [0u32; 2];
        c.next(a, &[], &mut mask).unwrap();
        assert_eq!(mask, [3000; 2]);
    }
}
