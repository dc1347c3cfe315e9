-- Models and deployments (SPEC §7.2, §9.2) and the usage ledger (§9.2).

CREATE TABLE model_groups (
    name         text PRIMARY KEY CHECK (name ~ '^[A-Za-z0-9._:/-]{1,100}$'),
    description  text NOT NULL DEFAULT '',
    created_at   timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL
);

-- deployments: credential_ciphertext is sealed with the key ring
-- (SLUICE_KEK); the plaintext is never stored. A deployment has prices or
-- is explicitly free.
CREATE TABLE deployments (
    id                     text PRIMARY KEY,
    model_group            text NOT NULL REFERENCES model_groups (name),
    api_base               text NOT NULL CHECK (api_base ~ '^https?://'),
    upstream_model         text NOT NULL CHECK (length(upstream_model) BETWEEN 1 AND 200),
    credential_ciphertext  bytea,
    weight                 integer NOT NULL CHECK (weight BETWEEN 1 AND 1000),
    max_concurrency        bigint NOT NULL DEFAULT 0 CHECK (max_concurrency >= 0),
    capabilities           jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(capabilities) = 'object'),
    tags                   text[] NOT NULL DEFAULT '{}',
    input_price            double precision NOT NULL DEFAULT 0 CHECK (input_price >= 0),
    output_price           double precision NOT NULL DEFAULT 0 CHECK (output_price >= 0),
    cached_input_price     double precision NOT NULL DEFAULT 0 CHECK (cached_input_price >= 0),
    free                   boolean NOT NULL DEFAULT false,
    created_at             timestamptz NOT NULL,
    updated_at             timestamptz NOT NULL,
    CHECK (free OR input_price > 0 OR output_price > 0)
);
CREATE INDEX deployments_group_idx ON deployments (model_group, id);

-- spend_logs: one row per request, idempotent on request_id (usage events
-- are redelivered after failures).
CREATE TABLE spend_logs (
    request_id         text PRIMARY KEY,
    at                 timestamptz NOT NULL,
    region             text NOT NULL DEFAULT '',
    instance_id        text NOT NULL DEFAULT '',
    org_id             text NOT NULL DEFAULT '',
    team_id            text NOT NULL DEFAULT '',
    user_id            text NOT NULL DEFAULT '',
    key_id             text NOT NULL DEFAULT '',
    project            text NOT NULL DEFAULT '',
    customer           text NOT NULL DEFAULT '',
    agent_id           text NOT NULL DEFAULT '',
    session_id         text NOT NULL DEFAULT '',
    tags               text[] NOT NULL DEFAULT '{}',
    traffic_class      text NOT NULL DEFAULT '',
    route              text NOT NULL DEFAULT '',
    requested_model    text NOT NULL DEFAULT '',
    model_group        text NOT NULL DEFAULT '',
    deployment_id      text NOT NULL DEFAULT '',
    stream             boolean NOT NULL DEFAULT false,
    prompt_tokens      bigint NOT NULL DEFAULT 0,
    completion_tokens  bigint NOT NULL DEFAULT 0,
    cached_tokens      bigint NOT NULL DEFAULT 0,
    cost_usd           double precision NOT NULL DEFAULT 0,
    status             integer NOT NULL DEFAULT 0,
    error_code         text NOT NULL DEFAULT '',
    latency_ms         bigint NOT NULL DEFAULT 0,
    ttft_ms            bigint NOT NULL DEFAULT 0,
    attempts           integer NOT NULL DEFAULT 0
);
CREATE INDEX spend_logs_org_time_idx ON spend_logs (org_id, at DESC);
CREATE INDEX spend_logs_key_time_idx ON spend_logs (key_id, at DESC);
CREATE INDEX spend_logs_team_time_idx ON spend_logs (team_id, at DESC);
CREATE INDEX spend_logs_time_idx ON spend_logs (at DESC);

-- spend_daily: aggregates per UTC day and scope, updated in the same
-- transaction as the spend_logs insert (only when that insert happened).
-- scope is one of org, team, user, key, customer, model_group, deployment,
-- tag; org_id is the org the spend belongs to.
CREATE TABLE spend_daily (
    day                date NOT NULL,
    scope              text NOT NULL,
    scope_id           text NOT NULL,
    org_id             text NOT NULL,
    requests           bigint NOT NULL DEFAULT 0,
    prompt_tokens      bigint NOT NULL DEFAULT 0,
    completion_tokens  bigint NOT NULL DEFAULT 0,
    cached_tokens      bigint NOT NULL DEFAULT 0,
    cost_usd           double precision NOT NULL DEFAULT 0,
    PRIMARY KEY (scope, scope_id, org_id, day)
);
