#!/usr/bin/env bash
# Session 16, call 12: call 11's ncu report printed per SASS instruction.
set -u
S=.scratch/s16
ncu -i $S/prof.ncu-rep --page source --csv --print-source sass > $OUT/source_sass.csv 2> $OUT/err.txt
ncu -i $S/prof.ncu-rep --page source --csv --print-source cuda,sass > $OUT/source_both.csv 2>> $OUT/err.txt
wc -l $OUT/*.csv; head -3 $OUT/source_sass.csv | cut -c1-600; cat $OUT/err.txt | head
