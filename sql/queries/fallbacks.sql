-- Fallback model groups and per-group resilience settings (SPEC §7.3).
-- Reads go through the owners' queries (SELECT *); these setters replace
-- them. Writers take ModelGroupFallbacksLock first, so two concurrent
-- changes cannot close a cycle the other did not see.

-- name: ModelGroupFallbacksLock :exec
SELECT pg_advisory_xact_lock(hashtext('sluice.model_group_fallbacks'));

-- name: ModelGroupResilienceSet :exec
UPDATE model_groups SET fallbacks = @fallbacks, resilience = @resilience, updated_at = @updated_at
WHERE name = @name;

-- name: ModelGroupFallbackGraph :many
SELECT name, fallbacks FROM model_groups ORDER BY name;

-- name: ModelGroupFallbackReferrers :many
SELECT name FROM model_groups WHERE @name::text = ANY (fallbacks) ORDER BY name;

-- name: KeyFallbacksSet :exec
UPDATE keys SET fallbacks = @fallbacks, updated_at = @updated_at WHERE org_id = @org_id AND id = @id;

-- name: TeamFallbacksSet :exec
UPDATE teams SET fallbacks = @fallbacks, updated_at = @updated_at WHERE org_id = @org_id AND id = @id;
