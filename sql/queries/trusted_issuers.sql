-- name: TrustedIssuerInsert :exec
INSERT INTO trusted_issuers (id, org_id, issuer, audience, jwks_url, team_claim, user_claim, customer_claim,
    unknown_policy, default_team_id, created_at, project_claim, tags_claim)
VALUES (@id, @org_id, @issuer, @audience, @jwks_url, @team_claim, @user_claim, @customer_claim,
    @unknown_policy, sqlc.narg(default_team_id), @created_at, @project_claim, @tags_claim);

-- name: TrustedIssuerGet :one
SELECT * FROM trusted_issuers
WHERE id = @id AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id));

-- name: TrustedIssuerGetForUpdate :one
SELECT * FROM trusted_issuers
WHERE id = @id AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
FOR UPDATE;

-- name: TrustedIssuerList :many
SELECT * FROM trusted_issuers
WHERE id > @after_id
  AND (sqlc.narg(org_id)::text IS NULL OR org_id = sqlc.narg(org_id))
ORDER BY id
LIMIT @lim;

-- name: TrustedIssuerDelete :exec
DELETE FROM trusted_issuers WHERE id = @id;

-- name: ConfigTrustedIssuers :many
SELECT * FROM trusted_issuers ORDER BY id;
