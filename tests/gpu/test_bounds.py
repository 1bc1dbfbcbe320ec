#!/usr/bin/env python3
"""Planted faults for the GPU scripts' pass rules (tests/gpu/bounds.py): each rule is fed the
numbers a broken build would give and must fail, and the numbers measured on a GPU must pass.
Runs anywhere: `python3 tests/gpu/test_bounds.py`."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bounds  # noqa: E402


class Bf16VsTransformers(unittest.TestCase):
    def test_measured_rows_pass(self):
        # docs/gpu-check-h200.md: (ours, transformers') on llama-gqa, bamba-b, mamba2-g2.
        for ours, hf in [(1.07e-2, 1.13e-2), (1.83e-2, 4.58e-1), (1.53e-2, 5.66e-1)]:
            self.assertTrue(bounds.bf16_logits(ours, hf)[1], (ours, hf))

    def test_zero_logits_fail_where_transformers_is_far_off(self):
        # All-zero logits score max|Δ|/max|ref| = 1.0; transformers' 0.566 on mamba2-g2 made
        # the old bound 1.13, which they passed.
        self.assertTrue(1.0 <= 2 * 0.566)
        self.assertFalse(bounds.bf16_logits(1.0, 0.566)[1])
        self.assertFalse(bounds.bf16_logits(1.0, 0.458)[1])
        # Logits 10 % off everywhere: 0.1.
        self.assertFalse(bounds.bf16_logits(0.1, 0.566)[1])
        self.assertFalse(bounds.bf16_logits(float("nan"), 0.01)[1])

    def test_ceiling_alone_where_transformers_f32_disagrees(self):
        self.assertTrue(bounds.bf16_logits(1.83e-2, None)[1])
        self.assertFalse(bounds.bf16_logits(1.0, None)[1])
        self.assertFalse(bounds.bf16_logprob(0.3, None)[1])
        # Measured on the H100 (2026-12-06) where transformers is no yardstick: bamba-b 0.158,
        # mamba2-g2 0.129.
        self.assertTrue(bounds.bf16_logprob(0.158, None)[1])
        self.assertTrue(bounds.bf16_logprob(0.129, None)[1])

    def test_twice_transformers_still_binds_where_it_is_small(self):
        self.assertFalse(bounds.bf16_logits(1.7e-2, 8.07e-3)[1])

    def test_logprob_ceiling(self):
        self.assertTrue(bounds.bf16_logprob(0.05, 0.02)[1])
        self.assertFalse(bounds.bf16_logprob(0.12, 0.02)[1])
        self.assertFalse(bounds.bf16_logprob(3.0, 2.0)[1])  # capped at 0.25 when hf is far off
        self.assertFalse(bounds.bf16_logprob(float("nan"), 0.01)[1])


class QuickServingBounds(unittest.TestCase):
    """The old QUICK=1 rows were `x >= bound or quick`: these numbers all passed."""

    def test_caching(self):
        self.assertTrue(bounds.caching_ttft(1.6, 0.6, True)[1])
        self.assertFalse(bounds.caching_ttft(0.8, 0.6, True)[1])  # caching slowed TTFT
        self.assertFalse(bounds.caching_ttft(1.2, 0.0, True)[1])  # nothing served from cache
        self.assertFalse(bounds.caching_ttft(2.0, 0.6, False)[1])

    def test_routing(self):
        self.assertTrue(bounds.routing_throughput(1.1, True)[1])
        self.assertFalse(bounds.routing_throughput(0.55, True)[1])  # one replica did it all
        self.assertFalse(bounds.routing_throughput(1.2, False)[1])

    def test_dynamo(self):
        self.assertTrue(bounds.dynamo_reuse(9000, 10000)[1])
        self.assertFalse(bounds.dynamo_reuse(5000, 10000)[1])  # round robin's share
        self.assertFalse(bounds.dynamo_reuse(0, 0)[1])  # nothing served from cache

    def test_idle(self):
        self.assertTrue(bounds.idle_share(0.02, 1.0, True)[1])
        self.assertFalse(bounds.idle_share(0.10, 1.0, True)[1])
        self.assertFalse(bounds.idle_share(0.0, 0.0, True)[1])  # nothing ran
        self.assertFalse(bounds.idle_share(0.02, 1.0, False)[1])

    def test_prefill(self):
        self.assertTrue(bounds.prefill_share(500, 700, True)[1])
        self.assertFalse(bounds.prefill_share(200, 700, True)[1])
        self.assertFalse(bounds.prefill_share(450, 700, False)[1])


if __name__ == "__main__":
    unittest.main()
