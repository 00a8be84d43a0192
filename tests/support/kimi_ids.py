"""Special-token ids of the embedded tiny tokenizer, shared by the output-parser tests."""
from k3jax.tokenizer import KimiTokenizer

TOK = KimiTokenizer.tiny()
SB = TOK.id_of("<|tool_calls_section_begin|>")
SE = TOK.id_of("<|tool_calls_section_end|>")
CB = TOK.id_of("<|tool_call_begin|>")
AB = TOK.id_of("<|tool_call_argument_begin|>")
CE = TOK.id_of("<|tool_call_end|>")
THINK, UNTHINK = TOK.id_of("<think>"), TOK.id_of("</think>")
EOS, IM_END = TOK.eos_id, TOK.im_end_id
E = TOK.encode
