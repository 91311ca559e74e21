#!/usr/bin/env bash
# kernel_tests_sharded.sh BINARY FILTER OUTDIR: on the GPU machine, runs a carried
# barqtrain_kernel_tests binary (built here, e.g. for sm_90a only) over FILTER in 8 parallel
# gtest shards, then memcheck, racecheck and synccheck over SANITIZE_FILTER when set (in
# parallel; the many-tile attention cases need minutes under them). Logs land in OUTDIR; prints
# the counts, every failure or skip, and each sanitizer's verdict. Exit status: 1 if any failed.
set -u
BIN=$1; FILTER=$2; OUTDIR=$3
mkdir -p "$OUTDIR"
for tool in ${SANITIZE_FILTER:+memcheck racecheck synccheck}; do
  (timeout "${SANITIZE_TIMEOUT:-400}" compute-sanitizer --tool "$tool" --error-exitcode 1 "$BIN" \
     --gtest_filter="$SANITIZE_FILTER" >"$OUTDIR/$tool.log" 2>&1
   echo "$tool rc $?" >>"$OUTDIR/$tool.log") &
done
for shard in 0 1 2 3 4 5 6 7; do
  GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$shard timeout 300 "$BIN" --gtest_filter="$FILTER" \
    >"$OUTDIR/tests_$shard.log" 2>&1 &
done
wait
cat "$OUTDIR"/tests_?.log >"$OUTDIR/tests.log" && rm "$OUTDIR"/tests_?.log
ok=$(grep -c '^\[       OK' "$OUTDIR/tests.log"); run=$(grep -c '^\[ RUN' "$OUTDIR/tests.log")
echo "kernel tests: $ok of $run passed"
grep -hE '^\[  (FAILED|SKIPPED) ' "$OUTDIR/tests.log" | sort -u
failed=$(( ok != run ))
for tool in ${SANITIZE_FILTER:+memcheck racecheck synccheck}; do
  tail -n 1 "$OUTDIR/$tool.log"
  grep -q "^$tool rc 0$" "$OUTDIR/$tool.log" || failed=1
done
exit $failed
