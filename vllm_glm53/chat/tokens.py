"""The 36 added (special) tokens of the GLM-5.3 tokenizer, in id order.

The released tokenizer places them contiguously right after the byte-level BPE vocabulary. Ids are never
hard-coded anywhere in the project: code asks the tokenizer (``convert_tokens_to_ids``) for them.
"""

ADDED_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|begin_of_audio|>",
    "<|end_of_audio|>",
    "<|begin_of_transcription|>",
    "<|end_of_transcription|>",
    "<|code_prefix|>",
    "<|code_middle|>",
    "<|code_suffix|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "/nothink",
    "<|begin_of_box|>",
    "<|end_of_box|>",
    "<|image|>",
    "<|video|>",
)

PAD_TOKEN = "<|endoftext|>"
# Generation stops on these: end of text, the next user turn, or a tool-call round handed back.
EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")

# Multimodal placeholders; the config's *_token_id fields point at these.
IMAGE_TOKEN = "<|image|>"
VIDEO_TOKEN = "<|video|>"
IMAGE_START_TOKEN = "<|begin_of_image|>"
IMAGE_END_TOKEN = "<|end_of_image|>"
VIDEO_START_TOKEN = "<|begin_of_video|>"
VIDEO_END_TOKEN = "<|end_of_video|>"
