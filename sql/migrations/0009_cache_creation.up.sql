-- Prompt-cache writes (Anthropic Messages' cache_creation_input_tokens) on
-- the ledger row; already counted in prompt_tokens and priced as input.
-- Rows written before this migration hold 0.
ALTER TABLE spend_logs ADD COLUMN cache_creation_tokens bigint NOT NULL DEFAULT 0;
