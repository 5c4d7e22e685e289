# Sourced by the demo scripts (after they set REPO, the clone's root): makes sure `python`, `tune` and
# `tune-grpo` come from an environment where torchtune_grpo is installed. The active environment wins;
# else the project's own .venv (made by `make setup`) is used; else the script stops, saying what to run,
# instead of failing later with a bare "ModuleNotFoundError: No module named 'torchtune_grpo'".

# Checked from / so that a torchtune_grpo/ folder in the current directory (the clone's root) does not
# pass for an installed package.
_grpo_importable() { command -v python >/dev/null 2>&1 && (cd / && python -c 'import torchtune_grpo') >/dev/null 2>&1; }

if ! _grpo_importable && [ -x "$REPO/.venv/bin/python" ]; then
  export VIRTUAL_ENV="$REPO/.venv"
  export PATH="$REPO/.venv/bin:$PATH"
  hash -r
  echo "using the project's virtual environment $VIRTUAL_ENV"
fi
if ! _grpo_importable; then
  if command -v python >/dev/null 2>&1; then
    found="\`python\` ($(command -v python)) cannot import torchtune_grpo"
  else
    found="there is no \`python\` on PATH"
  fi
  {
    echo "$(basename "$0"): $found, and $REPO/.venv has no working environment."
    echo "Set it up with \`make setup\` (in $REPO; \`make demo\` and \`make demo-multi-turn\` do it for you),"
    echo "or activate the environment you installed torchtune-grpo in (\`. $REPO/.venv/bin/activate\`), then run this again."
  } >&2
  exit 1
fi
unset -f _grpo_importable
