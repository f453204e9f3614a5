#!/bin/bash
# Stand-in ptxas: keeps each call's arguments, input PTX and output cubin, then runs the real one.
REAL=$(cat /tmp/real_ptxas)
d=/tmp/ptxdump; mkdir -p $d; n=$(date +%s%N)-$$
out=""; prev=""
for a in "$@"; do
  [ "$prev" = "-o" ] && out=$a
  [ "$prev" != "-o" ] && [ -f "$a" ] && cp "$a" $d/$n.ptx
  prev=$a
done
echo "$@" > $d/$n.args
"$REAL" "$@"; rc=$?
[ -n "$out" ] && [ -f "$out" ] && cp "$out" $d/$n.cubin
exit $rc
