"""/v1/embeddings on ``core serve --task embed`` (tiny random Llama, fp32 on CPU), HF-exact:
each vector equals the HF ``AutoModel`` last hidden state of the same token ids, pooled the
same way (last token / mean) and L2-normalized or not, computed here with plain torch.

The mean server runs with ``--max-num-batched-tokens 16``, so a long input is prefilled in
chunks (the runner sums across them); sending an input twice shows the prefix cache is not
used for mean pooling (a cache hit would drop the cached positions from the mean). The
openai SDK (which asks for base64 by default) checks the wire format end to end.
"""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import httpx2
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from tests.helpers import tiny_llama_dir, wait_for_server
from tests.integration import live_server

pytestmark = pytest.mark.slow

ALIAS = "embed-alias"
"""A second --served-model-name (live_server names the model "tiny" first)."""
TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello", "Embeddings are pooled hidden states " * 4]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="module")
def hf(model_dir):
    torch.manual_seed(0)
    return AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["last", "mean"])
def server(request, model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp(f"embed-{request.param}") / "server.log"
    extra = ["--task", "embed", "--pooling-type", request.param, "--served-model-name", ALIAS]
    if request.param == "mean":
        extra += ["--max-num-batched-tokens", "16"]
    srv = live_server.start(model_dir, log, *extra)
    wait_for_server(srv.proc, srv.url, srv.log)
    srv.pooling = request.param
    yield srv
    live_server.stop(srv)


def _reference(hf, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    _, model = hf
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [tokens, hidden]
    vec = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def _embed(server, **body) -> httpx2.Response:
    return httpx2.post(server.url + "/v1/embeddings", json={"model": "tiny", **body}, timeout=120)


@pytest.mark.parametrize("normalize", [True, False])
def test_text_inputs_match_hf_hidden_states(server, hf, normalize):
    tok, _ = hf
    r = _embed(server, input=TEXTS, normalize=normalize)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    ids = [tok.encode(t) for t in TEXTS]
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    assert len(ids[2]) > 16  # chunked on the mean server
    for d, i in zip(body["data"], ids):
        got = torch.tensor(d["embedding"])
        want = _reference(hf, i, server.pooling, normalize)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        if normalize:
            assert got.norm().item() == pytest.approx(1.0, abs=1e-5)


def test_token_id_inputs_and_a_repeat_give_the_same_vectors(server, hf):
    tok, _ = hf
    ids = tok.encode(TEXTS[2])
    first = _embed(server, input=ids).json()["data"][0]["embedding"]
    again = _embed(server, input=[ids, ids[:5]]).json()["data"]  # the repeat may hit the prefix cache
    torch.testing.assert_close(torch.tensor(again[0]["embedding"]), torch.tensor(first), atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(again[1]["embedding"]), _reference(hf, ids[:5], server.pooling, True),
                               atol=2e-5, rtol=1e-4)
    without_bos = _embed(server, input="hello", add_special_tokens=False).json()["data"][0]["embedding"]
    torch.testing.assert_close(torch.tensor(without_bos),
                               _reference(hf, tok.encode("hello", add_special_tokens=False), server.pooling, True),
                               atol=2e-5, rtol=1e-4)


def test_base64_and_the_openai_sdk(server, hf):
    tok, _ = hf
    floats = _embed(server, input="hello")
    b64 = _embed(server, input="hello", encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(b64.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.asarray(floats.json()["data"][0]["embedding"], dtype=np.float32))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    res = client.embeddings.create(model="tiny", input=["hello", TEXTS[0]])
    assert len(res.data) == 2 and res.usage.prompt_tokens == len(tok.encode("hello")) + len(tok.encode(TEXTS[0]))
    torch.testing.assert_close(torch.tensor(res.data[1].embedding),
                               _reference(hf, tok.encode(TEXTS[0]), server.pooling, True), atol=2e-5, rtol=1e-4)


def test_the_response_names_the_alias_sent(server):
    by_alias = _embed(server, input="hello", model=ALIAS)
    assert by_alias.status_code == 200, by_alias.text
    assert by_alias.json()["model"] == ALIAS
    assert _embed(server, input="hello").json()["model"] == "tiny"
    assert by_alias.json()["data"] == _embed(server, input="hello").json()["data"]


@pytest.mark.parametrize("body,param,fragment", [
    ({"input": "x", "dimensions": 8}, "dimensions", "dimensions=8 is not supported: this model's embeddings have 64"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ({"input": [1, 512]}, "input", "outside the vocabulary [0, 512)"),
    ({"input": list(range(3, 260))}, "input", "max_model_len is 256"),
    ({"input": ""}, "input", "(got '')"),
    ({"input": "x", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens", "Extra inputs are not permitted"),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
])
def test_refusals_name_the_field(server, body, param, fragment):
    r = _embed(server, **body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err


def test_the_hidden_size_is_accepted_as_dimensions(server):
    r = _embed(server, input="x", dimensions=64)
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64


@pytest.mark.parametrize("server", ["last"], indirect=True)  # the routes do not depend on the pooling type
def test_schemathesis_on_the_new_routes(server, tmp_path):
    """Bounded, seeded fuzzing of /v1/embeddings, /tokenize and /detokenize on an embedding
    server: no 5xx, every response as the schema says, every schema-invalid request refused."""
    st = Path(sys.executable).with_name("st")
    checks = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance," \
             "negative_data_rejection"
    cmd = [str(st), "run", server.url + "/openapi.json", "--checks", checks, "--include-path-regex",
           "^/(v1/embeddings|tokenize|detokenize)$", "--phases", "examples,coverage,fuzzing", "--max-examples", "25",
           "--seed", "1", "--generation-deterministic", "--request-timeout", "60", "--workers", "1",
           "--suppress-health-check", "all", "--report-dir", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    if res.returncode != 0:
        pytest.fail(f"schemathesis failed:\n{res.stdout[-8000:]}\n{res.stderr[-2000:]}")
    assert "Tested: 3" in res.stdout and "No issues found" in res.stdout, res.stdout[-3000:]
    assert "Traceback" not in server.log_text(), server.log_tail()
