-- Budgets (SPEC §8.3): the indexes that let the snapshot compiler sum a
-- budgeted scope's ledger spend in its window (Snapshot.budget_seeds), and
-- the budget alerts data planes raise.

-- Seeds of user and team-member budgets scan a user's rows in the window;
-- seeds of customer budgets an org's rows of one customer (external id).
-- Partial: requests without a user or customer (most, for service keys)
-- never touch these indexes. cost_usd is included so the scans are
-- index-only.
CREATE INDEX spend_logs_user_time_idx ON spend_logs (user_id, at) INCLUDE (cost_usd)
    WHERE user_id <> '';
CREATE INDEX spend_logs_customer_time_idx ON spend_logs (org_id, customer, at) INCLUDE (cost_usd)
    WHERE customer <> '';

-- budget_alerts: one row per alert a data plane raised (sluice.usage.v1.
-- BudgetAlert, stream SLUICE_ALERTS): a scope's spend crossed its soft
-- budget (threshold_percent 0) or a percentage of its hard cap in one
-- budget window. alert_id is deterministic ("<org>/<kind>/<scope id>/
-- <window>/<window start>/<threshold>"), so a republished or redelivered
-- alert inserts nothing. Amounts are micro-USD.
CREATE TABLE budget_alerts (
    alert_id           text PRIMARY KEY,
    fired_at           timestamptz NOT NULL,
    org_id             text NOT NULL,
    team_id            text NOT NULL DEFAULT '',
    scope_kind         text NOT NULL,
    scope_id           text NOT NULL,
    threshold_percent  integer NOT NULL,
    spend_micros       bigint NOT NULL,
    cap_micros         bigint NOT NULL,
    soft_micros        bigint NOT NULL,
    budget_duration    text NOT NULL,
    window_start       timestamptz NOT NULL,
    region             text NOT NULL DEFAULT '',
    instance_id        text NOT NULL DEFAULT '',
    request_id         text NOT NULL DEFAULT ''
);
-- ListAlerts reads newest first, keyset-paginated on (fired_at, alert_id),
-- within an org, a team or a scope.
CREATE INDEX budget_alerts_time_idx ON budget_alerts (fired_at DESC, alert_id DESC);
CREATE INDEX budget_alerts_org_time_idx ON budget_alerts (org_id, fired_at DESC, alert_id DESC);
CREATE INDEX budget_alerts_team_time_idx ON budget_alerts (team_id, fired_at DESC, alert_id DESC)
    WHERE team_id <> '';
CREATE INDEX budget_alerts_scope_time_idx ON budget_alerts (scope_kind, scope_id, fired_at DESC, alert_id DESC);
