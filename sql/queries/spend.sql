-- spend_logs rows are written by store.SpendRecord through COPY into a
-- staging table and one INSERT ... SELECT ... ON CONFLICT DO NOTHING
-- (controlplane/internal/store/spend.go), which sqlc cannot express.

-- name: SpendDailyAdd :exec
-- Adds pre-aggregated amounts to the daily aggregates. The caller passes
-- each (scope, scope_id, org_id, day) once, sorted, so concurrent
-- consumers lock rows in one order and never deadlock. (The unnest calls
-- in the select list run in lockstep: one row per array index.)
INSERT INTO spend_daily (day, scope, scope_id, org_id, requests, prompt_tokens, completion_tokens,
                         cached_tokens, cost_usd)
SELECT unnest(@days::date[]), unnest(@scopes::text[]), unnest(@scope_ids::text[]), unnest(@org_ids::text[]),
       unnest(@requests::bigint[]), unnest(@prompt_tokens::bigint[]), unnest(@completion_tokens::bigint[]),
       unnest(@cached_tokens::bigint[]), unnest(@costs::double precision[])
ON CONFLICT (scope, scope_id, org_id, day) DO UPDATE
SET requests          = spend_daily.requests + EXCLUDED.requests,
    prompt_tokens     = spend_daily.prompt_tokens + EXCLUDED.prompt_tokens,
    completion_tokens = spend_daily.completion_tokens + EXCLUDED.completion_tokens,
    cached_tokens     = spend_daily.cached_tokens + EXCLUDED.cached_tokens,
    cost_usd          = spend_daily.cost_usd + EXCLUDED.cost_usd;

-- name: SpendDailySum :one
-- Sums one scope over whole UTC days [start_day, end_day), optionally
-- within one org (tenant filter).
SELECT coalesce(sum(requests), 0)::bigint          AS requests,
       coalesce(sum(prompt_tokens), 0)::bigint     AS prompt_tokens,
       coalesce(sum(completion_tokens), 0)::bigint AS completion_tokens,
       coalesce(sum(cached_tokens), 0)::bigint     AS cached_tokens,
       coalesce(sum(cost_usd), 0)::double precision AS cost_usd
FROM spend_daily
WHERE scope = @scope AND scope_id = @scope_id
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND day >= @start_day::date AND day < @end_day::date;

-- name: SpendLogList :many
-- Newest first, keyset-paginated on (at, request_id).
SELECT * FROM spend_logs
WHERE (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
  AND (sqlc.narg(team_id)::text IS NULL OR team_id = sqlc.narg(team_id))
  AND (sqlc.narg(user_id)::text IS NULL OR user_id = sqlc.narg(user_id))
  AND (sqlc.narg(key_id)::text IS NULL OR key_id = sqlc.narg(key_id))
  AND (sqlc.narg(model_group)::text IS NULL OR model_group = sqlc.narg(model_group))
  AND (sqlc.narg(start_at)::timestamptz IS NULL OR at >= sqlc.narg(start_at))
  AND (sqlc.narg(end_at)::timestamptz IS NULL OR at < sqlc.narg(end_at))
  AND (sqlc.narg(after_at)::timestamptz IS NULL
       OR (at, request_id) < (sqlc.narg(after_at)::timestamptz, @after_id::text))
ORDER BY at DESC, request_id DESC
LIMIT @lim;
