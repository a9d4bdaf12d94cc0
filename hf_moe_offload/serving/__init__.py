"""`hf-moe-offload serve`: transformers' own OpenAI-compatible server (`transformers serve`) with its model loaded
through an offload policy.

The server, its endpoints, streaming and continuous batching are transformers'; this package changes how the model
is loaded (`manager.OffloadModelManager`) and adds one read-only endpoint, `/v1/offload/stats`. transformers offers
no extension point for either, so `hook.py` swaps two names of `transformers.cli.serving` while the server runs, and
`hook.check_transformers()` names what changed when transformers no longer has them.

Modules: `args` (the subcommand's flags), `cli` (its run), `hook`, `manager`, `request_checks` (a 400 for a
malformed field), `served_batching`. Needs the `serve` extra:
`pip install "hf-moe-offload[serve]"`.

Example:
    $ hf-moe-offload serve PATH --store disk --expert-cache 25% --port 8000
    $ curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20}'
"""
