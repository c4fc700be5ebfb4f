"""The provider options miles-e2b documents (shown by ``miles sandbox providers``).

A module of its own so the registration module can list them without importing the config
validation (discovery must stay cheap).
"""

OPTIONS = {
    "preset": "cloud (default) or agentenv",
    "api_key": "secret reference: env:NAME (default env:E2B_API_KEY) or file:/path",
    "domain": "sandbox domain (cloud: e2b.app; agentenv: the wildcard domain of its proxy)",
    "api_url": "control-plane URL (agentenv: http://<server>:8000)",
    "sandbox_url": "envd URL (agentenv: defaults to api_url)",
    "scheme": "scheme of exposed endpoints: https (cloud) or http (agentenv)",
    "workdir": "working directory inside sandboxes (default /home/user)",
    "template": "template for sandboxes created without an image (default: the SDK's)",
    "public_traffic": "true: exposed ports need no token (default false: e2b-traffic-access-token header)",
    "request_timeout_s": "seconds per API request (default: the SDK's)",
}
