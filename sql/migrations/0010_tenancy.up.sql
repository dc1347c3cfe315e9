-- Tenancy (docs/tenancy.md), alert delivery (docs/alerts.md) and admin
-- token rotation.

-- Model groups owned by tenants: a group is visible to the orgs it is
-- granted to, or to every org when it is platform-wide. Every group that
-- exists when this migration runs is marked platform-wide, so nothing
-- changes for current users; groups created afterwards are visible to no
-- org until they are granted (or marked platform-wide).
ALTER TABLE model_groups ADD COLUMN platform_wide boolean NOT NULL DEFAULT false;
UPDATE model_groups SET platform_wide = true;

CREATE TABLE model_group_grants (
    model_group text NOT NULL REFERENCES model_groups (name) ON DELETE CASCADE,
    org_id      text NOT NULL REFERENCES orgs (id) ON DELETE CASCADE,
    created_at  timestamptz NOT NULL,
    created_by  text NOT NULL,
    PRIMARY KEY (model_group, org_id)
);
CREATE INDEX model_group_grants_org_idx ON model_group_grants (org_id, model_group);

-- Admin token rotation with grace: the previous secret's hash is kept on
-- the same record until previous_valid_until.
ALTER TABLE admin_tokens
    ADD COLUMN previous_hash bytea CHECK (previous_hash IS NULL OR length(previous_hash) = 32),
    ADD COLUMN previous_pepper_version integer,
    ADD COLUMN previous_valid_until timestamptz,
    ADD COLUMN rotated_at timestamptz;
CREATE UNIQUE INDEX admin_tokens_previous_hash_idx ON admin_tokens (previous_hash) WHERE previous_hash IS NOT NULL;

-- Alert webhooks: endpoints of an org that receive its budget alerts. The
-- signing secret is sealed by the key ring (it must be usable to sign).
CREATE TABLE alert_webhooks (
    id                text PRIMARY KEY,
    org_id            text NOT NULL REFERENCES orgs (id) ON DELETE CASCADE,
    url               text NOT NULL CHECK (length(url) BETWEEN 1 AND 2000),
    description       text NOT NULL DEFAULT '',
    secret_ciphertext bytea NOT NULL,
    created_at        timestamptz NOT NULL,
    created_by        text NOT NULL
);
CREATE INDEX alert_webhooks_org_idx ON alert_webhooks (org_id, id);

-- alert_deliveries is the delivery outbox: one row per alert and webhook,
-- written in the transaction that records the alert, so no recorded alert
-- misses a delivery. delivery_id is the webhook-id header (the same for
-- every attempt). state: pending (next_attempt_at says when), delivered,
-- dead (the dead-letter list: max attempts reached).
CREATE TABLE alert_deliveries (
    delivery_id     text PRIMARY KEY,
    alert_id        text NOT NULL REFERENCES budget_alerts (alert_id) ON DELETE CASCADE,
    webhook_id      text NOT NULL REFERENCES alert_webhooks (id) ON DELETE CASCADE,
    org_id          text NOT NULL,
    state           text NOT NULL CHECK (state IN ('pending', 'delivered', 'dead')),
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL,
    last_error      text NOT NULL DEFAULT '',
    created_at      timestamptz NOT NULL,
    delivered_at    timestamptz,
    UNIQUE (alert_id, webhook_id)
);
CREATE INDEX alert_deliveries_due_idx ON alert_deliveries (next_attempt_at) WHERE state = 'pending';
CREATE INDEX alert_deliveries_org_idx ON alert_deliveries (org_id, created_at DESC, delivery_id DESC);
