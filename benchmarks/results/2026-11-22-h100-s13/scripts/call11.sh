#!/usr/bin/env bash
# Session 13, call 11: the grouped query tiles (branch perf/hopper-query-tiles-grouped): the
# Hopper and AllShapes kernel tests (8 shards) and memcheck / racecheck / synccheck over the
# forward's and backward's packed cases and the backward's many-tile, cross-length and one-token
# cases.
cd "$(dirname "$0")" && tar xJf bins11.tar.xz
REPO=$(cd ../.. && pwd)
F='HopperForward/*:HopperRope/*:HopperBackward/*:AttentionDispatch*:AttentionArguments*:HopperForwardLayout*:HopperBackwardLayout*:AllShapes/*'
SANITIZE_FILTER='HopperForward/*packed*:HopperBackward/*many_tiles*:HopperBackward/*packed*:HopperBackward/*cross_lengths*:HopperBackward/*_s1' \
  $REPO/scripts/kernel_tests_sharded.sh ./barqtrain_kernel_tests "$F" $OUT
