#!/usr/bin/env bash
# Session 17, call 8: the gradients kernel's runs of heads (key blocks first) without GQA too
# (B4 S4096 H32/32, the SPEC's case, added to the harness), against main's head after head.
set -u
tar -xJf .scratch/s17/v8.tar.xz -C .scratch/s17; V=.scratch/s17/v8
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/harness.log 3 $V/main $V/mha_runs
