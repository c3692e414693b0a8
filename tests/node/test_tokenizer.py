"""Specification of cadenza.node.frontend.tokenizer: loading a model folder, encoding, chat templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.processors import TemplateProcessing

import tiny_tokenizer as tiny
from cadenza.node.frontend.tokenizer import ChatTemplateError, Tokenizer, compile_chat_template

SMOLLM2_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
SMOLLM2_PROMPT_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
    407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
    520, 9531, 198,
]  # fmt: skip
USER_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]




@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build_tiny_tokenizer_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def model_dir(tiny_dir: Path, tmp_path: Path) -> Path:
    """A model folder holding only the tiny tokenizer.json; tests add the other files."""
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    return tmp_path


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data))


# --- the embedded SmolLM2 -------------------------------------------------------------------


def test_smollm2_chat_template_adds_default_system_prompt(smollm2: Tokenizer) -> None:
    assert smollm2.apply_chat_template(USER_QUESTION) == SMOLLM2_PROMPT


def test_smollm2_chat_prompt_encodes_to_reference_ids(smollm2: Tokenizer) -> None:
    prompt = smollm2.apply_chat_template(USER_QUESTION)
    assert smollm2.encode(prompt, add_special_tokens=False) == SMOLLM2_PROMPT_IDS
    assert smollm2.encode_chat(USER_QUESTION) == SMOLLM2_PROMPT_IDS


def test_smollm2_special_ids(smollm2: Tokenizer) -> None:
    assert 2 in smollm2.eos_token_ids
    assert smollm2.bos_token_id == 1
    assert smollm2.vocab_size == 49152
    assert smollm2.id_to_token(2) == "<|im_end|>"
    assert smollm2.id_to_token(10**7) is None


def test_smollm2_plain_text_round_trips(smollm2: Tokenizer) -> None:
    text = "Héllo, 世界! 😀 naïve"
    assert smollm2.decode(smollm2.encode(text)) == text


def test_generation_prompt_is_optional(smollm2: Tokenizer) -> None:
    prompt = smollm2.apply_chat_template(USER_QUESTION, add_generation_prompt=False)
    assert prompt == SMOLLM2_PROMPT.removesuffix("<|im_start|>assistant\n")


# --- loading a model folder -----------------------------------------------------------------


def test_missing_folder_raises_file_not_found_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")


def test_folder_without_tokenizer_json_raises_file_not_found(tmp_path: Path) -> None:
    write_json(tmp_path / "config.json", {})
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_malformed_files_raise_value_error_naming_the_file(model_dir: Path) -> None:
    (model_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(model_dir)
    (model_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(model_dir)


def test_special_tokens_accept_strings_and_added_token_dicts(model_dir: Path) -> None:
    write_json(
        model_dir / "tokenizer_config.json",
        {"bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|im_end|>"},
    )
    tok = Tokenizer.from_pretrained(model_dir)
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_ids) == ("<|im_end|>", frozenset({2}))


def test_eos_ids_are_the_union_of_config_generation_config_and_eos_token(
    model_dir: Path,
) -> None:
    write_json(model_dir / "tokenizer_config.json", {"eos_token": "<|im_end|>"})
    write_json(model_dir / "config.json", {"eos_token_id": 0, "bos_token_id": 1})
    write_json(model_dir / "generation_config.json", {"eos_token_id": [5, 7]})
    tok = Tokenizer.from_pretrained(model_dir)
    assert tok.eos_token_ids == frozenset({0, 2, 5, 7})
    assert tok.bos_token_id == 1  # from config.json, as no bos_token is named


def test_folder_with_only_tokenizer_json_has_no_specials(model_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(model_dir)
    assert tok.eos_token_ids == frozenset()
    assert tok.bos_token_id is None
    assert tok.chat_template is None


def test_add_bos_token_prepends_bos_the_post_processor_does_not_add(model_dir: Path) -> None:
    config = {"bos_token": "<|im_start|>", "add_bos_token": True}
    write_json(model_dir / "tokenizer_config.json", config)
    tok = Tokenizer.from_pretrained(model_dir)
    assert tok.encode("hi")[0] == 1
    assert tok.encode("hi", add_special_tokens=False)[0] != 1


def test_add_bos_token_false_drops_the_post_processors_bos(model_dir: Path) -> None:
    hf = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    hf.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    hf.save(str(model_dir / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>"}
    write_json(model_dir / "tokenizer_config.json", config)
    assert Tokenizer.from_pretrained(model_dir).encode("hi")[0] == 1
    write_json(model_dir / "tokenizer_config.json", {**config, "add_bos_token": False})
    tok = Tokenizer.from_pretrained(model_dir)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


# --- chat templates -------------------------------------------------------------------------

ECHO = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"


def test_template_from_tokenizer_config_string(model_dir: Path) -> None:
    write_json(model_dir / "tokenizer_config.json", {"chat_template": ECHO})
    tok = Tokenizer.from_pretrained(model_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user:hi]"


def test_template_list_form_uses_the_one_named_default(model_dir: Path) -> None:
    templates = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": ECHO}]
    write_json(model_dir / "tokenizer_config.json", {"chat_template": templates})
    tok = Tokenizer.from_pretrained(model_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user:hi]"


def test_chat_template_jinja_file_wins_over_the_config_entry(model_dir: Path) -> None:
    write_json(model_dir / "tokenizer_config.json", {"chat_template": "CONFIG"})
    (model_dir / "chat_template.jinja").write_text(ECHO)
    tok = Tokenizer.from_pretrained(model_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user:hi]"


def test_missing_template_raises_chat_template_error(model_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(model_dir)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(USER_QUESTION)


def test_raise_exception_in_template_raises_chat_template_error(model_dir: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    )
    write_json(model_dir / "tokenizer_config.json", {"chat_template": template})
    tok = Tokenizer.from_pretrained(model_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_errors_are_chat_template_errors_and_value_errors() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        compile_chat_template("{% for %}")
    assert issubclass(ChatTemplateError, ValueError)


def test_messages_that_do_not_fit_the_template_raise_chat_template_error(model_dir: Path) -> None:
    template = "{{ messages[0]['content'] + 1 }}"
    write_json(model_dir / "tokenizer_config.json", {"chat_template": template})
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_pretrained(model_dir).apply_chat_template(USER_QUESTION)


def test_template_sees_special_tokens_and_extra_variables(model_dir: Path) -> None:
    template = "{{ bos_token }}|{{ eos_token }}|{{ tools | length }}|{{ add_generation_prompt }}"
    write_json(
        model_dir / "tokenizer_config.json",
        {"chat_template": template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
    )
    tok = Tokenizer.from_pretrained(model_dir)
    rendered = tok.apply_chat_template([], add_generation_prompt=False, tools=[{}, {}])
    assert rendered == "<|im_start|>|<|im_end|>|2|False"


def test_tojson_keeps_non_ascii_and_supports_indent() -> None:
    template = compile_chat_template("{{ x | tojson }}/{{ x | tojson(indent=2) }}")
    assert template.render(x={"a": "é日😀"}) == '{"a": "é日😀"}/{\n  "a": "é日😀"\n}'


def test_templates_may_use_strftime_loop_controls_and_generation_blocks() -> None:
    template = compile_chat_template(
        "{{ strftime_now('%Y') | length }}:"
        "{% for i in [1, 2, 3] %}{% if i == 3 %}{% break %}{% endif %}"
        "{% generation %}{{ i }}{% endgeneration %}{% endfor %}"
    )
    assert template.render() == "4:12"


def test_template_trims_blocks_like_transformers() -> None:
    template = compile_chat_template("{% if true %}\n  a\n{% endif %}\nb")
    assert template.render() == "  a\nb"


def test_sandbox_blocks_access_to_python_internals(model_dir: Path) -> None:
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    write_json(model_dir / "tokenizer_config.json", {"chat_template": template})
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_pretrained(model_dir).apply_chat_template(USER_QUESTION)


# --- the tiny test tokenizer ----------------------------------------------------------------


def test_tiny_tokenizer_round_trips_text_with_accents_cjk_and_emoji(tiny_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(tiny_dir)
    for text in ["Café déjà vu", "日本語のテキスト", "Emoji 😀🚀 and 🇫🇷", "never seen: Ωμέγα ∑ ẞ"]:
        assert tok.decode(tok.encode(text)) == text


def test_tiny_tokenizer_has_chatml_specials_and_vocab_384(tiny_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(tiny_dir)
    assert [tok.id_to_token(i) for i in range(3)] == list(tiny.SPECIAL_TOKENS)
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, frozenset({2}))
    assert tok.vocab_size == tiny.tiny_vocab_size(tiny_dir) == tiny.TINY_VOCAB_SIZE == 384
    prompt = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert prompt[0] == 1 and prompt.count(2) == 2
    assert tok.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_tiny_tokenizer_builder_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    again = tiny.build_tiny_tokenizer_dir(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes()
