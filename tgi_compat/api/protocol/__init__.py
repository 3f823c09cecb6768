"""Wire formats: TGI and OpenAI request/response models, errors, SSE framing, the OpenAPI document."""
