"""Short chat templates of the shape of each model family's own (written here from the public templates'
documented behaviour: the turn markers, the default system message, where BOS and the thinking block go),
and each family's special tokens. Used by :mod:`tests.hf_families` for the tokenizers of its tiny checkpoints.

Each template keeps what distinguishes the family (Gemma's ``<start_of_turn>``/``model`` turns with the
system message folded into the first user turn, Gemma 4's ``<|turn>`` markers, Phi's ``<|user|>`` ...
``<|end|>``, Mistral's ``[INST]``, SmolLM3's metadata system block, Qwen3.5's open ``<think>`` generation
prompt); tool calling and multimodal content are left out.
"""

from tests.chat_templates import LLAMA3_2, QWEN2_5, QWEN3

# Qwen3.5: ChatML; the generation prompt opens a thinking block (closed empty with enable_thinking=False).
QWEN3_5 = """{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""

# Gemma 3: BOS written by the template, no system role (its text opens the first user turn), the
# assistant's role is called "model".
GEMMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""

# Gemma 4: BOS, a native system turn, <|turn>role ... <turn|> markers, "model" for the assistant.
GEMMA4 = """{{- bos_token }}
{%- for message in messages %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<|turn>' + role + '\\n' + message['content'] | trim + '<turn|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|turn>model\\n' }}
{%- endif %}
"""

# OLMo 3 instruct: ChatML with a default system message naming the model.
OLMO3 = """{%- if messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\\nYou are Olmo, a helpful AI assistant built by Ai2.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# SmolLM3: ChatML whose system turn is a metadata block (reasoning mode) followed by custom instructions.
SMOLLM3 = """{%- set reasoning_mode = '/no_think' if (enable_thinking is defined and enable_thinking is false) else '/think' %}
{%- if messages[0]['role'] == 'system' %}
    {%- set custom = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set custom = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|im_start|>system\\n## Metadata\\n\\nKnowledge Cutoff Date: June 2025\\nReasoning Mode: ' + reasoning_mode + '\\n\\n## Custom Instructions\\n\\n' + custom + '\\n\\n<|im_end|>\\n' }}
{%- for message in loop_messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Phi-3 / Phi-4-mini: <|role|> headers, <|end|> closing every turn.
PHI3 = """{%- for message in messages %}
    {{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>' }}
{%- endif %}
"""

# Mistral (v0.3 instruct): BOS, [INST] ... [/INST] around user turns (the system message joins the last user
# turn), assistant text closed by EOS.
MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- else %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""

# Ministral 3: BOS, the system prompt in [SYSTEM_PROMPT] tags, [INST] ... [/INST] user turns.
MINISTRAL3 = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}
    {%- elif message['role'] == 'user' %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- else %}
        {{- message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""

# gpt-oss (harmony): <|start|>role<|message|>text<|end|> turns; the generation prompt opens the assistant's
# final channel; a finished answer ends with <|return|>.
GPT_OSS = """{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}
    {%- else %}
        {{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start|>assistant<|channel|>final<|message|>' }}
{%- endif %}
"""

# OLMoE instruct (Tulu): <|role|> headers on their own line, assistant turns closed by EOS.
OLMOE = """{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}
    {%- else %}
        {{- '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\\n' }}
{%- endif %}
"""

CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
GEMMA = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
GEMMA3_VISION = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA4_SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"]
GEMMA4_MEDIA = ["<|image>", "<image|>", "<|image|>", "<|video|>", "<|audio>", "<audio|>", "<|audio|>"]
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
GPT_OSS_SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"]
OLMOE_SPECIALS = ["<|endoftext|>", "<|padding|>", "<|system|>", "<|user|>", "<|assistant|>"]

__all__ = ["CHATML", "GEMMA", "GEMMA3", "GEMMA3_VISION", "GEMMA4", "GEMMA4_MEDIA", "GEMMA4_SPECIALS", "GPT_OSS",
           "GPT_OSS_SPECIALS", "LLAMA3", "LLAMA3_2", "MINISTRAL3", "MISTRAL", "MISTRAL_SPECIALS", "OLMO3", "OLMOE",
           "OLMOE_SPECIALS", "PHI3", "QWEN2_5", "QWEN3", "QWEN3_5", "QWEN_VISION", "SMOLLM3"]
