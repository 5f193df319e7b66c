"""Train the bundled demo model: a tiny Ouro-architecture looped LM on GSM8K train.

The network is the product's own module code (`rlt_engine.models.ouro.OuroForCausalLM`): sandwich
norms, a shared stack of layers looped `total_ut_steps` = 4 times, `model.norm` after every
loop, and the learned exit gate. Only the attention backend is ours: training runs every loop
over whole packed sequences, without a cache, each loop attending to its own K/V only (the Ouro
training semantics: one KV slot per (loop, layer)).

Stage 1 (whole model), the Ouro objective: with hazards λ_t = sigmoid(gate(h_t)), the exit
distribution is p_t = λ_t Π_{i<t}(1 - λ_i) for t < T-1 and p_{T-1} = Π_{i<T-1}(1 - λ_i); the loss
is Σ_t p_t · CE_t - β · H(p), averaged over tokens, with β annealed linearly. Training-only
regularisation (dropout hooks; the gate bias starts at λ ≈ 0.2 so the deep loops get most of the
early gradient) and early stopping on 200 held-out train problems keep the 4.5M-parameter model
from memorising the 1.3M-token corpus, so that held-out loss keeps falling with depth.
Stage 2 (gate only, body frozen): per-token targets "stop once no later loop improves the
cross-entropy by more than a margin", fitted with binary cross-entropy on the hazards.

Seeded and deterministic: on one kind of GPU the same command writes the same bytes.
GSM8K is read from --data-dir, default $RLT_SHARED_DIR/datasets/gsm8k or ../shared/datasets/gsm8k.

Examples:
    python tools/train_demo_model.py --out rlt_engine/assets/ouro-gsm8k-tiny --tokenizer-only
    python tools/train_demo_model.py --out rlt_engine/assets/ouro-gsm8k-tiny --device cuda
    python tools/train_demo_model.py --out /tmp/demo-smoke --smoke
"""

# The recipe, one job a module:
#   data       GSM8K problems -> training text (plain and ChatML documents), token windows
#   tokenizer  byte-level BPE training and the Hugging Face tokenizer files
#   options    TrainOptions and the command line
#   backend    the training attention backend, the forward over every loop, dropout hooks
#   objective  gate logits, per-loop cross-entropy, the exit distribution and loss, gate targets
#   trainer    stage 1 (whole model) and stage 2 (gate only), with logging and early stopping
#   train      the whole run: data, tokenizer, config, model, both stages, checkpoint; main()
