#!/bin/bash
# DualPipeV with and without the cross-chunk overlap, and 1f1b, on the emulated cluster: 4 nodes x 1 rank
# (ranks are pipe-outermost, so 2 x 2 would keep the EP pair inside a node; here every EP and PP exchange
# crosses a shaped link). Alternated A/B/C, REPS repetitions. Usage: lab/dualpipev_overlap/run.sh RATE REPS OUT
RATE=${1:-100mbit}; REPS=${2:-2}; OUT=${3:-runs/dpv_overlap}
mkdir -p "$OUT"
common="--deepspeed_config ds_configs/cpu_fp32.json --model lab/dualpipev_overlap/mixtral_small.json --pp 2
  --expert-model-parallel-size 2 --seq-length 32 --global-batch-size 16 --micro-batch-size 1 --steps 5 --lr 1e-4
  --pipeline-balance uniform"
for rep in $(seq 1 "$REPS"); do
  for variant in dualpipev overlap 1f1b; do
    case $variant in
      dualpipev) extra="--pipeline-schedule dualpipev";;
      overlap) extra="--pipeline-schedule dualpipev --overlap-moe-expert-parallel-comm";;
      1f1b) extra="--pipeline-schedule 1f1b";;
    esac
    /usr/bin/time -f "%U %S %e" -o "$OUT/$variant.$rep.time" \
      python -m mtds.cluster run --prefix dpv- --timeout 300 --nodes 4 --ranks-per-node 1 --inter-node "$RATE" --out "$OUT/$variant.$rep" \
      -- train.py $common $extra > "$OUT/$variant.$rep.log" 2>&1
    echo "$variant rep $rep rc $? $(cat $OUT/$variant.$rep.time)"
  done
done
