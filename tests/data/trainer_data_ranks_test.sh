#!/usr/bin/env bash
# The example trainer with --data: the data loader keeps the run the same at every rank count. With the global batch
# a multiple of the 12 logical shards and a rank count that divides them, 1, 2, 3, 4 and 6 ranks, and a run saved
# on 4 ranks and resumed on 3 or on 2, print every step's loss within 1e-6 relative of the 1-rank run. A --data
# location that does not exist or holds no token files, and a rank count that does not divide the logical shards,
# are errors that say what to do. A run started with --init-data while another writes the built-in text there waits
# for its sidecar.
# usage: trainer_data_ranks_test.sh SHARDKIT_RUN TRAINER
set -euo pipefail
run=$1 trainer=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=1
flags=(--batch 12 --context 8 --width 16 --blocks 1 --data "$work/data" --init-data)
losses() { grep -o 'step [0-9]* loss [^ ]*' || true; }
# same NAME FILE: every step of FILE is the reference's step within 1e-6 relative
same() {
  awk -v name="$1" 'NR == FNR { want[$2] = $4; next }
    { n++; d = $4 - want[$2]; if (d < 0) d = -d; a = want[$2]; if (a < 0) a = -a
      if (!($2 in want) || d > 1e-6 * a) { printf "FAIL: %s: step %s loss %s, the 1-rank run %s\n", name, $2, $4, want[$2]; bad = 1 } }
    END { if (n == 0) { printf "FAIL: %s printed no step\n", name; bad = 1 }; exit bad }' reference.txt "$2"
}
cd "$work"
"$run" -n 1 -- "$trainer" --steps 6 "${flags[@]}" | losses > reference.txt  # rank 0 writes the built-in text first
echo "1 rank:"; cat reference.txt
[ "$(wc -l < reference.txt)" = 6 ] || { echo "FAIL: the 1-rank run printed $(wc -l < reference.txt) steps, not 6"; exit 1; }
for n in 2 3 4 6; do
  "$run" -n "$n" -- "$trainer" --steps 6 "${flags[@]}" | losses > "ranks$n.txt"
  same "$n ranks" "ranks$n.txt"
done
echo "OK: 2, 3, 4 and 6 ranks train as 1 rank does"
"$run" -n 4 -- "$trainer" --steps 3 "${flags[@]}" --ckpt-dir "$work/ckpt" --ckpt-every 3 --ckpt-mode at-call > saved.txt
for n in 3 2; do
  rm -rf "$work/resume$n" && cp -r "$work/ckpt" "$work/resume$n"
  "$run" -n "$n" -- "$trainer" --steps 6 "${flags[@]}" --ckpt-dir "$work/resume$n" --resume > "resumed$n.txt"
  grep -q "resumed from step 3 of .* (saved by 4 ranks, loaded by $n)" "resumed$n.txt" ||
    { echo "FAIL: no resume on $n ranks"; cat "resumed$n.txt"; exit 1; }
  losses < "resumed$n.txt" > "resumed${n}_losses.txt"
  [ "$(wc -l < "resumed${n}_losses.txt")" = 3 ] || { echo "FAIL: the resume on $n ranks did not train steps 3 to 5"; exit 1; }
  same "4 -> $n ranks" "resumed${n}_losses.txt"
done
echo "OK: saved on 4 ranks and resumed on 3 and on 2, the losses are the uninterrupted run's"
# A global batch that the 12 logical shards do not divide trains differently on other rank counts: rank 0 says so.
"$run" -n 2 -- "$trainer" --steps 1 --batch 16 --context 8 --width 16 --blocks 1 --data "$work/data" > odd.txt 2> odd.err
grep -q "warning: --batch 16 is not a multiple of the data loader's 12 logical shards.*--batch 12 or 24" odd.err ||
  { echo "FAIL: --batch 16 with --data gave no warning"; cat odd.err; exit 1; }
[ "$(grep -c 'warning: --batch' odd.err)" = 1 ] || { echo "FAIL: the warning is not printed once"; cat odd.err; exit 1; }
"$run" -n 2 -- "$trainer" --steps 1 "${flags[@]}" 2> even.err > /dev/null
! grep -q "warning: --batch" even.err || { echo "FAIL: --batch 12 warned"; cat even.err; exit 1; }
echo "OK: --batch 16 with --data warns once; --batch 12 does not"
# A mistyped --data path is an error naming it (it is not created, nor trained on as the built-in text); so is a
# directory without token files (one holding only a text not tokenized names it); 5 ranks do not divide the 12 logical shards, and the message says which do.
refused() {  # NAME REGEX COMMAND...: fails (non-zero) and says REGEX
  local name=$1 regex=$2
  shift 2
  if "$@" > refused.out 2>&1; then echo "FAIL: $name: exit 0"; cat refused.out; exit 1; fi
  grep -qE -- "$regex" refused.out || { echo "FAIL: $name: no /$regex/"; cat refused.out; exit 1; }
}
small=(--steps 1 --batch 12 --context 8 --width 16 --blocks 1)
refused "a mistyped --data" "--data $work/dta: no such directory \\(a mistyped path\\?\\).*--init-data" \
  "$run" -n 2 -- "$trainer" "${small[@]}" --data "$work/dta"
[ ! -e "$work/dta" ] || { echo "FAIL: the mistyped --data directory was created"; exit 1; }
mkdir "$work/empty"
refused "--data of no token files" "--data $work/empty holds no token files: write token files there with shardkit-tokenize" \
  "$run" -n 2 -- "$trainer" "${small[@]}" --data "$work/empty"
mkdir "$work/notes" && echo "some text" > "$work/notes/notes.txt"
refused "--data of a text not tokenized" "--data $work/notes holds no token files \\(it holds notes.txt: not token files, .*\\): write token files there" \
  "$run" -n 2 -- "$trainer" "${small[@]}" --data "$work/notes"
refused "5 ranks with --data" "--data: 5 ranks do not divide the data loader's 12 logical shards .*run on 1, 2, 3, 4, 6 or 12 ranks" \
  "$run" -n 5 -- "$trainer" --steps 1 --batch 15 --context 8 --width 16 --blocks 1 --data "$work/data"
echo "OK: a mistyped --data, a --data of no token files and 5 ranks are refused, saying what to do"
# Two runs started at once with --init-data on one new location: the second finds the first's token file written
# and its sidecar (written last) not yet. It waits for it rather than reading the file without one.
mkdir "$work/racing"
cp "$work/data/builtin.tokens" "$work/data/builtin.tokens.offsets" "$work/racing/"
(sleep 1 && cp "$work/data/builtin.tokens.json" "$work/racing/builtin.tokens.json.tmp" &&
  mv "$work/racing/builtin.tokens.json.tmp" "$work/racing/builtin.tokens.json") &
"$run" -n 2 -- "$trainer" --steps 6 "${flags[@]/$work\/data/$work/racing}" | losses > racing.txt
wait
same "--init-data beside another run's" racing.txt
echo "OK: --init-data beside another run writing the built-in text waits for its sidecar and trains as 1 rank does"
