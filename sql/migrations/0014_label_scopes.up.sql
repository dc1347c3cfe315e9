-- Project and tag scopes (docs/limits.md, "Project and tag scopes"): a
-- project or a tag of an org with its own limits and budget. Keys carry
-- projects and tags as free-form labels; a label with a row here becomes a
-- scope every request of such a key is checked against.
CREATE TABLE label_scopes (
    id          text PRIMARY KEY,
    org_id      text NOT NULL REFERENCES orgs (id),
    kind        text NOT NULL CHECK (kind IN ('project', 'tag')),
    name        text NOT NULL CHECK (length(name) BETWEEN 1 AND 100),
    limits      jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(limits) = 'object'),
    created_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL,
    UNIQUE (org_id, kind, name)
);

-- Budget seeds of project scopes read whole days from spend_daily (scope
-- 'project', scope_id the project), like tags, which spend_daily has
-- aggregated from the start. The ledger aggregates projects from now on;
-- this backfills the days already recorded, so a project budget created
-- today counts the project's spend earlier in its window.
INSERT INTO spend_daily (day, scope, scope_id, org_id, requests, prompt_tokens, completion_tokens, cached_tokens, cost_usd)
SELECT (at AT TIME ZONE 'UTC')::date, 'project', project, org_id, count(*), sum(prompt_tokens), sum(completion_tokens),
       sum(cached_tokens), sum(cost_usd)
FROM spend_logs
WHERE project <> ''
GROUP BY 1, 3, 4
ON CONFLICT (scope, scope_id, org_id, day) DO NOTHING;
