#!/usr/bin/env bash
# Every scheduled system on every bench model its framework has, at every rate, then one table.
#
#   usage: scripts/bench_matrix.sh [OUT]          (as root: the shaped links need network namespaces)
#
# Each (model, rate) is one `bytescheduler bench` run that alternates the systems of a
# framework block by block; the summary is `bytescheduler bench-summary OUT/*/results.json`.
# Environment: RATES (default "none 1gbit 2gbit"), MODELS (default: all below), ROUNDS_LARGE
# (default 6: about a second per iteration) and ROUNDS_SMALL (default 16: tens of ms per
# iteration, where the gaps are small and the noise large; these runs also time the A/A
# controls ddp-again, hvd-again and mxnet-again, a second copy of each baseline), CELLS (instead of
# MODELS x RATES: "model:rate ..." in the order given, e.g. "vgg:1gbit mlp:1gbit"),
# PYTHON_BIN (default .venv/bin). Takes several hours on the project's 2-core
# machine (the twentieth round's 21 cells: about 2.5 hours); nothing else should run
# meanwhile (the figures are ratios, but a busy machine widens their spread).
set -euo pipefail

cd "$(dirname "$0")/.."
OUT=${1:-bench-results/matrix}
BIN=${PYTHON_BIN:-.venv/bin}
RATES=${RATES:-none 1gbit 2gbit}
ROUNDS_LARGE=${ROUNDS_LARGE:-6}
ROUNDS_SMALL=${ROUNDS_SMALL:-16}
# model: iterations per block (small models: more, so that a block lasts a fraction of a second)
declare -A ITERS=([vgg]=10 [mlp]=10 [transformer]=10 [resnet]=20 [gpt2-small]=40 [cnn-small]=40 [vgg-small]=20)
MODELS=${MODELS:-vgg mlp transformer resnet gpt2-small cnn-small vgg-small}
# MXNet's bench has these models (bytescheduler/bench/mxnet_models.py)
MXNET_MODELS=" vgg vgg-small cnn-small mlp "

if [ -z "${CELLS:-}" ]; then
    CELLS=""
    for model in $MODELS; do
        for rate in $RATES; do
            CELLS="$CELLS $model:$rate"
        done
    done
fi

mkdir -p "$OUT"
for cell in $CELLS; do
    model=${cell%%:*}
    rate=${cell##*:}
    systems="compute ddp ddp-hook scheduled hvd hvd-scheduled"
    controls="ddp-again hvd-again"
    if [[ "$MXNET_MODELS" == *" $model "* ]]; then
        systems="$systems mxnet mxnet-scheduled"
        controls="$controls mxnet-again"
    fi
    rounds=$ROUNDS_SMALL
    if [ "${ITERS[$model]}" -le 10 ]; then
        rounds=$ROUNDS_LARGE
    else
        systems="$systems $controls"
    fi
    echo "=== $model at $rate: $systems ($rounds rounds)"
    # shellcheck disable=SC2086
    "$BIN/bytescheduler" bench --bandwidth "$rate" --model "$model" --systems $systems \
        --rounds "$rounds" --iters "${ITERS[$model]}" --warmup 3 --out "$OUT/$model-$rate" \
        || echo "!!! $model at $rate failed" >&2
done
"$BIN/bytescheduler" bench-summary "$OUT"/*/results.json | tee "$OUT/summary.md"
