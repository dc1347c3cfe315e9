-- name: TeamMemberInsert :exec
INSERT INTO team_members (team_id, user_id, org_id, max_budget_in_team, limits, created_at, updated_at)
VALUES (@team_id, @user_id, @org_id, sqlc.narg(max_budget_in_team), @limits, @created_at, @created_at);

-- name: TeamMemberGetForUpdate :one
SELECT * FROM team_members
WHERE org_id = @org_id AND team_id = @team_id AND user_id = @user_id
FOR UPDATE;

-- name: TeamMemberList :many
SELECT * FROM team_members
WHERE org_id = @org_id AND team_id = @team_id AND user_id > @after_user_id
ORDER BY user_id
LIMIT @lim;

-- name: TeamMemberUpdate :exec
UPDATE team_members SET max_budget_in_team = sqlc.narg(max_budget_in_team), limits = @limits, updated_at = @updated_at
WHERE org_id = @org_id AND team_id = @team_id AND user_id = @user_id;

-- name: TeamMemberDelete :exec
DELETE FROM team_members WHERE org_id = @org_id AND team_id = @team_id AND user_id = @user_id;

-- TeamMemberUserExists tells whether user_id names a user of org_id (a
-- membership may only join a team and a user of the same org).
-- name: TeamMemberUserExists :one
SELECT EXISTS (SELECT 1 FROM users WHERE org_id = @org_id AND id = @user_id)::boolean AS user_exists;
