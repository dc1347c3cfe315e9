-- Ledger spend of budgeted scopes in their budget windows, for the
-- snapshot's budget seeds (SPEC §8.3). Each query takes one kind's scopes
-- as parallel arrays (one element per scope; the unnest calls in the
-- select list run in lockstep) and answers one row per scope, idx being
-- the caller's index of it. One query per kind keeps every lookup on an
-- index: a snapshot of 100k keys of which a few carry budgets costs a few
-- index probes, not one round trip per scope.
--
-- Kinds that spend_daily aggregates (key, user, team, org, customer,
-- project, tag) read the whole UTC days of the window [day_from, day_to)
-- from spend_daily and only the partial days at its edges from spend_logs: [start_at, head_end)
-- and [tail_start, end_at). Both tables change in the same transaction, so
-- one statement sees them consistent. Day and month windows start and end
-- at UTC midnights: a monthly org budget reads at most 31 daily rows and
-- no request at all. Member, key_model and team_model scopes have no daily
-- aggregate and sum spend_logs over [start_at, end_at). Sums are numeric,
-- so they do not depend on the order rows are read.

-- name: BudgetSpendKey :many
WITH s AS (
    SELECT unnest(@idx::int[]) AS idx, unnest(@ids::text[]) AS id, unnest(@org_ids::text[]) AS org_id,
           unnest(@start_ats::timestamptz[]) AS start_at, unnest(@head_ends::timestamptz[]) AS head_end,
           unnest(@day_froms::date[]) AS day_from, unnest(@day_tos::date[]) AS day_to,
           unnest(@tail_starts::timestamptz[]) AS tail_start, unnest(@end_ats::timestamptz[]) AS end_at
)
SELECT s.idx::int AS idx, (
    coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.key_id = s.id AND l.at >= s.start_at AND l.at < s.head_end), 0)
  + coalesce((SELECT sum(d.cost_usd::numeric) FROM spend_daily d
              WHERE d.scope = 'key' AND d.scope_id = s.id AND d.org_id = s.org_id
                AND d.day >= s.day_from AND d.day < s.day_to), 0)
  + coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.key_id = s.id AND l.at >= s.tail_start AND l.at < s.end_at), 0)
)::double precision AS cost_usd
FROM s;

-- name: BudgetSpendUser :many
WITH s AS (
    SELECT unnest(@idx::int[]) AS idx, unnest(@ids::text[]) AS id, unnest(@org_ids::text[]) AS org_id,
           unnest(@start_ats::timestamptz[]) AS start_at, unnest(@head_ends::timestamptz[]) AS head_end,
           unnest(@day_froms::date[]) AS day_from, unnest(@day_tos::date[]) AS day_to,
           unnest(@tail_starts::timestamptz[]) AS tail_start, unnest(@end_ats::timestamptz[]) AS end_at
)
SELECT s.idx::int AS idx, (
    coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.user_id <> '' AND l.user_id = s.id AND l.at >= s.start_at AND l.at < s.head_end), 0)
  + coalesce((SELECT sum(d.cost_usd::numeric) FROM spend_daily d
              WHERE d.scope = 'user' AND d.scope_id = s.id AND d.org_id = s.org_id
                AND d.day >= s.day_from AND d.day < s.day_to), 0)
  + coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.user_id <> '' AND l.user_id = s.id AND l.at >= s.tail_start AND l.at < s.end_at), 0)
)::double precision AS cost_usd
FROM s;

-- name: BudgetSpendTeam :many
WITH s AS (
    SELECT unnest(@idx::int[]) AS idx, unnest(@ids::text[]) AS id, unnest(@org_ids::text[]) AS org_id,
           unnest(@start_ats::timestamptz[]) AS start_at, unnest(@head_ends::timestamptz[]) AS head_end,
           unnest(@day_froms::date[]) AS day_from, unnest(@day_tos::date[]) AS day_to,
           unnest(@tail_starts::timestamptz[]) AS tail_start, unnest(@end_ats::timestamptz[]) AS end_at
)
SELECT s.idx::int AS idx, (
    coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.team_id = s.id AND l.at >= s.start_at AND l.at < s.head_end), 0)
  + coalesce((SELECT sum(d.cost_usd::numeric) FROM spend_daily d
              WHERE d.scope = 'team' AND d.scope_id = s.id AND d.org_id = s.org_id
                AND d.day >= s.day_from AND d.day < s.day_to), 0)
  + coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.team_id = s.id AND l.at >= s.tail_start AND l.at < s.end_at), 0)
)::double precision AS cost_usd
FROM s;

-- name: BudgetSpendOrg :many
WITH s AS (
    SELECT unnest(@idx::int[]) AS idx, unnest(@ids::text[]) AS id,
           unnest(@start_ats::timestamptz[]) AS start_at, unnest(@head_ends::timestamptz[]) AS head_end,
           unnest(@day_froms::date[]) AS day_from, unnest(@day_tos::date[]) AS day_to,
           unnest(@tail_starts::timestamptz[]) AS tail_start, unnest(@end_ats::timestamptz[]) AS end_at
)
SELECT s.idx::int AS idx, (
    coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.org_id = s.id AND l.at >= s.start_at AND l.at < s.head_end), 0)
  + coalesce((SELECT sum(d.cost_usd::numeric) FROM spend_daily d
              WHERE d.scope = 'org' AND d.scope_id = s.id AND d.org_id = s.id
                AND d.day >= s.day_from AND d.day < s.day_to), 0)
  + coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.org_id = s.id AND l.at >= s.tail_start AND l.at < s.end_at), 0)
)::double precision AS cost_usd
FROM s;

-- name: BudgetSpendCustomer :many
-- A customer's requests carry its external id (customer) within its org.
WITH s AS (
    SELECT unnest(@idx::int[]) AS idx, unnest(@org_ids::text[]) AS org_id, unnest(@external_ids::text[]) AS external_id,
           unnest(@start_ats::timestamptz[]) AS start_at, unnest(@head_ends::timestamptz[]) AS head_end,
           unnest(@day_froms::date[]) AS day_from, unnest(@day_tos::date[]) AS day_to,
           unnest(@tail_starts::timestamptz[]) AS tail_start, unnest(@end_ats::timestamptz[]) AS end_at
)
SELECT s.idx::int AS idx, (
    coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.customer <> '' AND l.org_id = s.org_id AND l.customer = s.external_id
                AND l.at >= s.start_at AND l.at < s.head_end), 0)
  + coalesce((SELECT sum(d.cost_usd::numeric) FROM spend_daily d
              WHERE d.scope = 'customer' AND d.scope_id = s.external_id AND d.org_id = s.org_id
                AND d.day >= s.day_from AND d.day < s.day_to), 0)
  + coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.customer <> '' AND l.org_id = s.org_id AND l.customer = s.external_id
                AND l.at >= s.tail_start AND l.at < s.end_at), 0)
)::double precision AS cost_usd
FROM s;

-- name: BudgetSpendProject :many
-- A project scope's requests are those of the org's keys with that
-- project (spend_daily scope 'project', from migration 0013 on).
WITH s AS (
    SELECT unnest(@idx::int[]) AS idx, unnest(@org_ids::text[]) AS org_id, unnest(@names::text[]) AS name,
           unnest(@start_ats::timestamptz[]) AS start_at, unnest(@head_ends::timestamptz[]) AS head_end,
           unnest(@day_froms::date[]) AS day_from, unnest(@day_tos::date[]) AS day_to,
           unnest(@tail_starts::timestamptz[]) AS tail_start, unnest(@end_ats::timestamptz[]) AS end_at
)
SELECT s.idx::int AS idx, (
    coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.org_id = s.org_id AND l.project = s.name AND l.at >= s.start_at AND l.at < s.head_end), 0)
  + coalesce((SELECT sum(d.cost_usd::numeric) FROM spend_daily d
              WHERE d.scope = 'project' AND d.scope_id = s.name AND d.org_id = s.org_id
                AND d.day >= s.day_from AND d.day < s.day_to), 0)
  + coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.org_id = s.org_id AND l.project = s.name AND l.at >= s.tail_start AND l.at < s.end_at), 0)
)::double precision AS cost_usd
FROM s;

-- name: BudgetSpendTag :many
-- A tag scope's requests are those of the org's keys carrying the tag
-- (spend_daily scope 'tag').
WITH s AS (
    SELECT unnest(@idx::int[]) AS idx, unnest(@org_ids::text[]) AS org_id, unnest(@names::text[]) AS name,
           unnest(@start_ats::timestamptz[]) AS start_at, unnest(@head_ends::timestamptz[]) AS head_end,
           unnest(@day_froms::date[]) AS day_from, unnest(@day_tos::date[]) AS day_to,
           unnest(@tail_starts::timestamptz[]) AS tail_start, unnest(@end_ats::timestamptz[]) AS end_at
)
SELECT s.idx::int AS idx, (
    coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.org_id = s.org_id AND s.name = ANY (l.tags) AND l.at >= s.start_at AND l.at < s.head_end), 0)
  + coalesce((SELECT sum(d.cost_usd::numeric) FROM spend_daily d
              WHERE d.scope = 'tag' AND d.scope_id = s.name AND d.org_id = s.org_id
                AND d.day >= s.day_from AND d.day < s.day_to), 0)
  + coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
              WHERE l.org_id = s.org_id AND s.name = ANY (l.tags) AND l.at >= s.tail_start AND l.at < s.end_at), 0)
)::double precision AS cost_usd
FROM s;

-- name: BudgetSpendMember :many
WITH s AS (
    SELECT unnest(@idx::int[]) AS idx, unnest(@team_ids::text[]) AS team_id, unnest(@user_ids::text[]) AS user_id,
           unnest(@start_ats::timestamptz[]) AS start_at, unnest(@end_ats::timestamptz[]) AS end_at
)
SELECT s.idx::int AS idx,
       coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
                 WHERE l.user_id <> '' AND l.user_id = s.user_id AND l.team_id = s.team_id
                   AND l.at >= s.start_at AND l.at < s.end_at), 0)::double precision AS cost_usd
FROM s;

-- name: BudgetSpendKeyModel :many
WITH s AS (
    SELECT unnest(@idx::int[]) AS idx, unnest(@key_ids::text[]) AS key_id, unnest(@model_groups::text[]) AS model_group,
           unnest(@start_ats::timestamptz[]) AS start_at, unnest(@end_ats::timestamptz[]) AS end_at
)
SELECT s.idx::int AS idx,
       coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
                 WHERE l.key_id = s.key_id AND l.model_group = s.model_group
                   AND l.at >= s.start_at AND l.at < s.end_at), 0)::double precision AS cost_usd
FROM s;

-- name: BudgetSpendTeamModel :many
WITH s AS (
    SELECT unnest(@idx::int[]) AS idx, unnest(@team_ids::text[]) AS team_id, unnest(@model_groups::text[]) AS model_group,
           unnest(@start_ats::timestamptz[]) AS start_at, unnest(@end_ats::timestamptz[]) AS end_at
)
SELECT s.idx::int AS idx,
       coalesce((SELECT sum(l.cost_usd::numeric) FROM spend_logs l
                 WHERE l.team_id = s.team_id AND l.model_group = s.model_group
                   AND l.at >= s.start_at AND l.at < s.end_at), 0)::double precision AS cost_usd
FROM s;
