"""Chat rendering: token ids equal transformers' apply_chat_template; the loss mask is the assistant turns."""

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from mtjax.data import chat

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Qwen2.5's template, trimmed of tools; a bad role exercises raise_exception.
CHATML = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# The same with transformers' generation tags around what the mask must cover.
CHATML_TAGGED = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# Tags around the answer only, and earlier turns without their reasoning (as Qwen3 renders them).
TAGGED_ANSWERS = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'] if loop.last"
    " else message['content'].split('</think>')[-1] %}"
    "{% generation %}{{- content }}{% endgeneration %}"
    "{%- else %}{{- message['content'] }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. What is the capital of France?",
    "Paris is the capital of France, and it is known for the Eiffel tower.",
    "system user assistant hello world, how are you today?",
    "Numbers like 1234 and 56 appear too;\n\n  with  spaces and new lines\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello, how are you?"},
     {"role": "assistant", "content": "I am fine, thank you."}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "  Paris.\n\n It is  known for the tower. "},
     {"role": "user", "content": "And 1234?"},
     {"role": "assistant", "content": "A number."}],
]


def make_tokenizer(directory, template=CHATML, eos="<|im_end|>", bos=None, vocab=320,
                   specials=SPECIALS):
  """Trains a tiny byte-level BPE and writes tokenizer.json + tokenizer_config.json into `directory`."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=True)
  trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(SENTENCES * 4, trainer)
  directory.mkdir(parents=True, exist_ok=True)
  tok.save(str(directory / "tokenizer.json"))
  cfg = {"eos_token": {"content": eos, "special": True}, "pad_token": "<|endoftext|>",
         "tokenizer_class": "PreTrainedTokenizerFast"}
  if bos:
    cfg["bos_token"] = bos
  if template is not None:
    cfg["chat_template"] = template
  (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
  return directory


def hf_tokenizer(directory):
  from transformers import PreTrainedTokenizerFast
  cfg = json.loads((directory / "tokenizer_config.json").read_text())
  return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                 eos_token=chat.token_text(cfg["eos_token"]),
                                 bos_token=cfg.get("bos_token"), pad_token=cfg["pad_token"],
                                 chat_template=cfg["chat_template"])


def runs(mask):
  """(start, end) of each run of ones."""
  edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
  return list(zip(edges[::2], edges[1::2]))


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_ids_equal_transformers_and_mask_is_the_assistant_turns(tmp_path, style):
  if style == "chatml":
    d, end = make_tokenizer(tmp_path), "<|im_end|>"
  else:
    d = make_tokenizer(tmp_path, LLAMA3, eos="<|eot_id|>", bos="<|begin_of_text|>")
    end = "<|eot_id|>"
  tok = Tokenizer.from_file(str(d / "tokenizer.json"))
  template = chat.ChatTemplate.from_tokenizer(d)
  hf = hf_tokenizer(d)
  for msgs in CONVERSATIONS:
    ids, mask = chat.encode_chat(tok, template, msgs)
    want = hf.apply_chat_template(msgs, tokenize=True, return_dict=False)
    assert ids.tolist() == list(want)
    assert template.render(msgs) == hf.apply_chat_template(msgs, tokenize=False)
    answers = [m["content"] for m in msgs if m["role"] == "assistant"]
    got = [tok.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in runs(mask)]
    strip = str.strip if style == "llama3" else (lambda s: s)  # Llama 3 trims the content
    assert got == [strip(a) + end for a in answers]
  assert template.mask_method == "render_diff"


def test_mask_equals_transformers_generation_tags(tmp_path):
  d = make_tokenizer(tmp_path, CHATML_TAGGED)
  tok = Tokenizer.from_file(str(d / "tokenizer.json"))
  template = chat.ChatTemplate.from_tokenizer(d)
  hf = hf_tokenizer(d)
  for msgs in CONVERSATIONS:
    ids, mask = chat.encode_chat(tok, template, msgs)
    want = hf.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert ids.tolist() == want["input_ids"]
    assert mask.tolist() == want["assistant_masks"]
  assert template.mask_method == "generation_tags"


def test_generation_tags_mark_what_transformers_marks_where_cuts_differ(tmp_path):
  d = make_tokenizer(tmp_path, TAGGED_ANSWERS)
  tok = Tokenizer.from_file(str(d / "tokenizer.json"))
  template = chat.ChatTemplate.from_tokenizer(d)
  hf = hf_tokenizer(d)
  msgs = [{"role": "user", "content": "Hello, how are you?"},
          {"role": "assistant", "content": "<think>Be kind.</think>I am fine, thank you."},
          {"role": "user", "content": "And 1234?"},
          {"role": "assistant", "content": "<think>A number.</think>A number."},
          {"role": "user", "content": "The capital of France?"},
          {"role": "assistant", "content": "<think>Easy.</think>Paris."}]
  ids, mask = chat.encode_chat(tok, template, msgs)
  want = hf.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                return_assistant_tokens_mask=True)
  assert ids.tolist() == want["input_ids"]
  assert mask.tolist() == want["assistant_masks"]
  got = [tok.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in runs(mask)]
  assert got == ["I am fine, thank you.", "A number.", "<think>Easy.</think>Paris."]
  assert template.mask_method == "generation_tags"


def test_template_from_jinja_file_and_errors(tmp_path):
  d = make_tokenizer(tmp_path / "a", template=None)
  with pytest.raises(ValueError, match="no chat_template"):
    chat.ChatTemplate.from_tokenizer(d)
  (d / "chat_template.jinja").write_text(CHATML)
  t = chat.ChatTemplate.from_tokenizer(d / "tokenizer.json")
  assert t.render(CONVERSATIONS[0]).startswith("<|im_start|>system\n")
  assert t.special_tokens["eos_token"] == "<|im_end|>"
  with pytest.raises(ValueError, match="unknown role tool"):
    t.render([{"role": "tool", "content": "x"}])
  with pytest.raises(FileNotFoundError, match="tokenizer"):
    chat.ChatTemplate.from_tokenizer(tmp_path / "missing")


def test_template_that_leaves_out_earlier_turns_masks_what_it_renders():
  # Renders only the last assistant message: the earlier one is nowhere in the rendering.
  t = chat.ChatTemplate("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
                        "{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}")
  text, spans = t.assistant_spans(CONVERSATIONS[1])
  assert text == ("system: Be brief.\nuser: What is the capital of France?\nuser: And 1234?\n"
                  "assistant: A number.\n")
  assert [text[a:b] for a, b in spans] == ["assistant: A number."]
  assert t.mask_method == "render_diff"
  none = chat.ChatTemplate("{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}"
                           "{% endif %}{% endfor %}")
  with pytest.raises(ValueError, match="none of the assistant messages"):
    none.assistant_spans(CONVERSATIONS[1])


# ---------------------------------------------------------------------------------------------
# Templates as models ship them (tests/templates/README.md says where from), whose rendering of a
# cut of the conversation is not a prefix of the whole rendering.

TEMPLATES = Path(__file__).parent / "templates"

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "<think>\nThe user asks about France.\n</think>\n\nParis."},
    {"role": "user", "content": "And 1234?"},
    {"role": "assistant", "content": "A number, like 56."},
    # ends as the previous answer does: the turn's end must not be found by its text alone
    {"role": "user", "content": "You said:\n\nA number, like 56."},
    {"role": "assistant", "content": "<think>Be polite.</think>I am fine, thank you."},
]
BYE = {"role": "user", "content": "Hello world."}
# The same without reasoning, for templates that render the content as it is.
PLAIN = [m if m["role"] != "assistant" else
         {"role": "assistant", "content": m["content"].split("</think>")[-1].strip()} for m in CHAT]


def assert_masks_the_turns(d, msgs, turns, method="render_diff"):
  """encode_chat gives transformers' ids, and its mask runs decode to `turns`, one per turn."""
  tok = Tokenizer.from_file(str(d / "tokenizer.json"))
  template = chat.ChatTemplate.from_tokenizer(d)
  hf = hf_tokenizer(d)
  ids, mask = chat.encode_chat(tok, template, msgs)
  assert ids.tolist() == list(hf.apply_chat_template(msgs, tokenize=True, return_dict=False))
  text = hf.apply_chat_template(msgs, tokenize=False)
  assert template.render(msgs) == text
  got = [tok.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in runs(mask)]
  assert got == turns
  assert template.mask_method == method
  return text


@pytest.mark.parametrize("last", ["assistant", "user"])
def test_qwen3_masks_each_turn_as_the_whole_rendering_holds_it(tmp_path, last):
  d = make_tokenizer(tmp_path, (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(),
                     specials=SPECIALS + ["<think>", "</think>"])
  msgs = CHAT + ([BYE] if last == "user" else [])
  # Qwen3 keeps only the answer of a turn before the last user message; a turn after it (the last
  # one here when the conversation ends with it) gets its reasoning back in think tags.
  final = ("<think>\nBe polite.\n</think>\n\nI am fine, thank you." if last == "assistant"
           else "I am fine, thank you.")
  text = assert_masks_the_turns(
      d, msgs, ["Paris.<|im_end|>", "A number, like 56.<|im_end|>", final + "<|im_end|>"])
  assert "The user asks about France." not in text


@pytest.mark.parametrize("last", ["assistant", "user"])
def test_mistral_v3_with_a_system_message_masks_each_turn(tmp_path, last):
  d = make_tokenizer(tmp_path,
                     (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text(),
                     eos="</s>", bos="<s>",
                     specials=["<|endoftext|>", "<s>", "</s>", "[INST]", "[/INST]"])
  msgs = PLAIN + ([BYE] if last == "user" else [])
  text = assert_masks_the_turns(
      d, msgs, ["Paris.</s>", "A number, like 56.</s>", "I am fine, thank you.</s>"])
  # The template puts the system message into the last user message: into none when the
  # conversation ends with the assistant, so a cut before a turn holds it and the whole does not.
  assert ("Be brief." in text) == (last == "user")


def test_phi3_ending_the_conversation_with_eos_masks_each_turn(tmp_path):
  d = make_tokenizer(tmp_path, (TEMPLATES / "microsoft-Phi-3.5-mini-instruct.jinja").read_text(),
                     eos="<|endoftext|>",
                     specials=["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>",
                               "<|end|>"])
  # EOS follows the last turn's end only; the next header, not EOS, follows the others'.
  assert_masks_the_turns(d, PLAIN, ["Paris.<|end|>", "A number, like 56.<|end|>",
                                    "I am fine, thank you.<|end|>\n<|endoftext|>"])


def test_unknown_roles_and_empty_assistant_messages_are_refused():
  t = chat.ChatTemplate(CHATML)
  with pytest.raises(ValueError, match=r"messages\[1\] has unknown role 'bot'"):
    chat.check_messages([{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}])
  with pytest.raises(ValueError, match=r"messages\[1\] is an empty assistant message"):
    chat.encode_chat(None, t, [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": " \n "}])
  chat.check_messages([{"role": r, "content": "x"} for r in chat.ROLES])
