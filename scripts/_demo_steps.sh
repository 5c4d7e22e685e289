# Sourced by scripts/demo.sh, scripts/demo_multi_turn.sh and scripts/demo_process_rewards.sh, after they set
# REPO, WORK, SEED, SFT_EPOCHS and GRPO_STEPS (and WARM_START, shipped | sft, for warm_start): what the demos do
# around their own data and GRPO stage.

# One thread per process: on 2 shared cores, 2 OpenMP threads per process were much slower (barriers
# stall when another process holds a core), and results do not depend on the core count.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TOKENIZERS_PARALLELISM=false
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1

START=$(date +%s)
elapsed() { echo "$(( $(date +%s) - START ))s"; }
step() { echo; echo "==== [$(elapsed)] $*"; }

rm -rf "$WORK"
mkdir -p "$WORK"
cd "$WORK"  # `tune run` finds the recipes as installed modules, from any directory

# sft_stage LABEL CONFIG DATA_FILE: torchtune's own SFT recipe (full_finetune_single_device) on DATA_FILE
# from the shipped random init (tiny_qwen2), SFT_EPOCHS epochs, DEMO_SFT_ARGS appended; sets WARM_DIR and
# WARM_FILE to its last epoch's checkpoint.
sft_stage() {
  local label="$1" sft_config="$2" data_file="$3" asset_dir
  asset_dir="$(python -c 'from torchtune_grpo.assets import asset_path; print(asset_path("tiny_qwen2"))')"
  step "$label SFT warm start: tune run full_finetune_single_device (torchtune's recipe), $SFT_EPOCHS epoch(s)"
  tune run full_finetune_single_device --config "$sft_config" \
    asset_dir="$asset_dir" dataset.data_files="$data_file" dataset.cache_dir="$WORK/hf_cache" \
    output_dir="$WORK/sft" epochs="$SFT_EPOCHS" seed="$SEED" ${DEMO_SFT_ARGS:-} > "$WORK/sft.log" 2>&1 \
    || { tail -n 40 "$WORK/sft.log"; exit 1; }
  WARM_DIR="$WORK/sft/epoch_$((SFT_EPOCHS - 1))"
  WARM_FILE=model-00001-of-00001.safetensors  # the name torchtune's SFT recipe writes
  echo "SFT checkpoint: $WARM_DIR/$WARM_FILE (log: $WORK/sft.log)"
}

# warm_start LABEL ASSET: sets WARM_DIR and WARM_FILE to the shipped SFT checkpoint ASSET, or with
# DEMO_WARM_START=sft runs the calling script's sft_warm_start (its data, then sft_stage); then stops the
# script when DEMO_GRPO_STEPS=0 (how the shipped checkpoints are remade).
warm_start() {
  local label="$1" asset="$2"
  case "$WARM_START" in
    shipped)
      WARM_DIR="$(python -c "from torchtune_grpo.assets import asset_path; print(asset_path('$asset'))")"
      WARM_FILE=model.safetensors
      step "$label warm start: the shipped SFT checkpoint $WARM_DIR (DEMO_WARM_START=sft trains it here)" ;;
    sft) sft_warm_start ;;
    *) echo "DEMO_WARM_START must be 'shipped' or 'sft', got '$WARM_START'" >&2; exit 2 ;;
  esac
  if [ "$GRPO_STEPS" -eq 0 ]; then
    echo "DEMO_GRPO_STEPS=0: stopping after the warm start (outputs in $WORK)"
    exit 0
  fi
}
