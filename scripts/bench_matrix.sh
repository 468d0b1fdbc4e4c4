#!/usr/bin/env bash
# Every scheduled system on every bench model its framework has, at every rate, then one table.
#
#   usage: scripts/bench_matrix.sh [OUT]          (as root: the shaped links need network namespaces)
#
# Each (model, rate) is one `bytescheduler bench` run that alternates the systems of a
# framework block by block; the summary is `bytescheduler bench-summary OUT/*/results.json`.
# Environment: RATES (default "none 1gbit 2gbit"), MODELS (default: all below), ROUNDS
# (default 8), PYTHON_BIN (default .venv/bin). Takes several hours on the project's 2-core
# machine; nothing else should run meanwhile (the figures are ratios, but a busy machine
# widens their spread).
set -euo pipefail

cd "$(dirname "$0")/.."
OUT=${1:-bench-results/matrix}
BIN=${PYTHON_BIN:-.venv/bin}
RATES=${RATES:-none 1gbit 2gbit}
ROUNDS=${ROUNDS:-8}
# model: iterations per block (small models: more, so a block lasts about a second)
declare -A ITERS=([vgg]=10 [mlp]=10 [transformer]=10 [resnet]=20 [gpt2-small]=20 [cnn-small]=20 [vgg-small]=20)
MODELS=${MODELS:-vgg mlp transformer resnet gpt2-small cnn-small vgg-small}
# MXNet's bench has these models (bytescheduler/bench/mxnet_models.py)
MXNET_MODELS=" vgg vgg-small cnn-small mlp "

mkdir -p "$OUT"
for model in $MODELS; do
    for rate in $RATES; do
        systems="compute ddp ddp-hook scheduled hvd hvd-scheduled"
        if [[ "$MXNET_MODELS" == *" $model "* ]]; then
            systems="$systems mxnet mxnet-scheduled"
        fi
        echo "=== $model at $rate: $systems"
        # shellcheck disable=SC2086
        "$BIN/bytescheduler" bench --bandwidth "$rate" --model "$model" --systems $systems \
            --rounds "$ROUNDS" --iters "${ITERS[$model]}" --warmup 3 --out "$OUT/$model-$rate" \
            || echo "!!! $model at $rate failed" >&2
    done
done
"$BIN/bytescheduler" bench-summary "$OUT"/*/results.json | tee "$OUT/summary.md"
