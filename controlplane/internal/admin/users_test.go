package admin

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/internal/ids"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Helpers shared by the user and customer tests ("uc" prefix keeps them
// apart from the helpers of other services' tests).

// ucAudit is one audit row as these tests see it.
type ucAudit struct {
	Action, ObjectType, OrgID, Before, After string
}

// ucAuditRows returns the audit rows of objectID in order.
func ucAuditRows(t *testing.T, b *bundle, objectID string) []ucAudit {
	t.Helper()
	rows, err := b.pool.Query(context.Background(),
		`SELECT action, object_type, org_id, before_json, after_json FROM audit_log WHERE object_id = $1 ORDER BY seq`, objectID)
	require.NoError(t, err)
	defer rows.Close()
	var out []ucAudit
	for rows.Next() {
		var a ucAudit
		require.NoError(t, rows.Scan(&a.Action, &a.ObjectType, &a.OrgID, &a.Before, &a.After))
		out = append(out, a)
	}
	require.NoError(t, rows.Err())
	return out
}

// ucAuditActions returns the audit actions recorded for objectID, in order.
func ucAuditActions(t *testing.T, b *bundle, objectID string) []string {
	t.Helper()
	var out []string
	for _, a := range ucAuditRows(t, b, objectID) {
		out = append(out, a.Action)
	}
	return out
}

// ucOutbox returns "kind org_id object_type" for every outbox row of
// objectID, in order.
func ucOutbox(t *testing.T, b *bundle, objectID string) []string {
	t.Helper()
	rows, err := b.pool.Query(context.Background(),
		`SELECT kind || ' ' || org_id || ' ' || object_type FROM outbox WHERE object_id = $1 ORDER BY seq`, objectID)
	require.NoError(t, err)
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		out = append(out, s)
	}
	require.NoError(t, rows.Err())
	return out
}

// ucOneAudit runs a mutation and requires that it wrote exactly one audit
// row.
func ucOneAudit(t *testing.T, b *bundle, fn func() error) {
	t.Helper()
	n := b.auditCount()
	require.NoError(t, fn())
	require.Equal(t, n+1, b.auditCount(), "a mutation writes exactly one audit row")
}

// ucExec runs SQL directly against the test database.
func ucExec(t *testing.T, b *bundle, sql string, args ...any) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

// ucMkTeam inserts a team directly (the team API is not needed here).
func ucMkTeam(t *testing.T, b *bundle, orgID, name string) string {
	t.Helper()
	id := ids.New(ids.Team)
	ucExec(t, b, `INSERT INTO teams (id, org_id, name, created_at, updated_at) VALUES ($1, $2, $3, now(), now())`, id, orgID, name)
	return id
}

// ucMkKey inserts a key owned by userID directly.
func ucMkKey(t *testing.T, b *bundle, orgID, userID string) string {
	t.Helper()
	id := ids.New(ids.Key)
	hash := []byte(strings.Repeat("h", 16) + id[len(id)-16:])
	ucExec(t, b, `INSERT INTO keys (id, org_id, user_id, token_hash, pepper_version, display_prefix, last4, created_at, updated_at)
		VALUES ($1, $2, $3, $4, 1, 'sk-sluice-', 'abcd', now(), now())`, id, orgID, userID, hash)
	return id
}

func mkUser(t *testing.T, b *bundle, c clients, orgID, email string) *adminv1.User {
	t.Helper()
	resp, err := c.User.CreateUser(context.Background(), connect.NewRequest(&adminv1.CreateUserRequest{OrgId: orgID, Email: email}))
	require.NoError(t, err)
	return resp.Msg.User
}

func TestUserLifecycle(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.root()
	org := b.mkOrg("acme")

	var u *adminv1.User
	ucOneAudit(t, b, func() error {
		resp, err := c.User.CreateUser(ctx, connect.NewRequest(&adminv1.CreateUserRequest{
			OrgId: org.Id, Email: "Alice@Example.COM", DisplayName: "Alice",
			Limits:   &adminv1.Limits{MaxBudget: proto.Float64(50), BudgetDuration: "30d", RpmLimit: proto.Int64(60)},
			Metadata: map[string]string{"dept": "research"},
		}))
		if err == nil {
			u = resp.Msg.User
		}
		return err
	})
	require.True(t, ids.Valid(ids.User, u.Id), u.Id)
	require.Equal(t, org.Id, u.OrgId)
	require.Equal(t, "alice@example.com", u.Email, "emails are stored lower-cased")
	require.Equal(t, "Alice", u.DisplayName)
	require.Equal(t, 50.0, u.Limits.GetMaxBudget())
	require.Equal(t, map[string]string{"dept": "research"}, u.Metadata)
	require.False(t, u.Blocked)
	require.Equal(t, b.clock.Now(), u.CreateTime.AsTime())

	got, err := c.User.GetUser(ctx, connect.NewRequest(&adminv1.GetUserRequest{Id: u.Id}))
	require.NoError(t, err)
	require.True(t, proto.Equal(u, got.Msg.User), "get returns what create returned")

	mkUser(t, b, c, org.Id, "bob@example.com")
	list, err := c.User.ListUsers(ctx, connect.NewRequest(&adminv1.ListUsersRequest{OrgId: org.Id, EmailPrefix: "ALI"}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Users, 1, "the prefix filter is case-insensitive like the emails")
	require.Equal(t, u.Id, list.Msg.Users[0].Id)

	b.clock.Advance(1000000000)
	var upd *adminv1.User
	ucOneAudit(t, b, func() error {
		resp, err := c.User.UpdateUser(ctx, connect.NewRequest(&adminv1.UpdateUserRequest{
			User: &adminv1.User{Id: u.Id, Email: "ALICE@corp.example", DisplayName: "ignored",
				Limits: &adminv1.Limits{RpmLimit: proto.Int64(120), MaxBudget: proto.Float64(1)}},
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"email", "limits.rpm_limit"}},
		}))
		if err == nil {
			upd = resp.Msg.User
		}
		return err
	})
	require.Equal(t, "alice@corp.example", upd.Email)
	require.Equal(t, "Alice", upd.DisplayName, "fields outside the mask are kept")
	require.Equal(t, int64(120), upd.Limits.GetRpmLimit())
	require.Equal(t, 50.0, upd.Limits.GetMaxBudget(), "limit fields outside the mask are kept")
	require.Equal(t, b.clock.Now(), upd.UpdateTime.AsTime())
	require.Equal(t, u.CreateTime.AsTime(), upd.CreateTime.AsTime())

	ucOneAudit(t, b, func() error {
		_, err := c.User.UpdateUser(ctx, connect.NewRequest(&adminv1.UpdateUserRequest{
			User:       &adminv1.User{Id: u.Id, DisplayName: "Alice A.", Metadata: map[string]string{"team": "x"}},
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"display_name", "metadata", "limits"}},
		}))
		return err
	})
	got, err = c.User.GetUser(ctx, connect.NewRequest(&adminv1.GetUserRequest{Id: u.Id}))
	require.NoError(t, err)
	require.Equal(t, "Alice A.", got.Msg.User.DisplayName)
	require.Equal(t, map[string]string{"team": "x"}, got.Msg.User.Metadata)
	require.True(t, proto.Equal(&adminv1.Limits{}, got.Msg.User.Limits), "limits in the mask but unset are cleared")

	ucOneAudit(t, b, func() error {
		resp, err := c.User.BlockUser(ctx, connect.NewRequest(&adminv1.BlockUserRequest{Id: u.Id}))
		if err == nil {
			require.True(t, resp.Msg.User.Blocked)
		}
		return err
	})
	list, err = c.User.ListUsers(ctx, connect.NewRequest(&adminv1.ListUsersRequest{Blocked: proto.Bool(true)}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Users, 1)
	require.Equal(t, u.Id, list.Msg.Users[0].Id)
	list, err = c.User.ListUsers(ctx, connect.NewRequest(&adminv1.ListUsersRequest{Blocked: proto.Bool(false)}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Users, 1)
	require.Equal(t, "bob@example.com", list.Msg.Users[0].Email)

	ucOneAudit(t, b, func() error {
		resp, err := c.User.UnblockUser(ctx, connect.NewRequest(&adminv1.UnblockUserRequest{Id: u.Id}))
		if err == nil {
			require.False(t, resp.Msg.User.Blocked)
		}
		return err
	})
	ucOneAudit(t, b, func() error {
		_, err := c.User.DeleteUser(ctx, connect.NewRequest(&adminv1.DeleteUserRequest{Id: u.Id}))
		return err
	})
	_, err = c.User.GetUser(ctx, connect.NewRequest(&adminv1.GetUserRequest{Id: u.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = c.User.DeleteUser(ctx, connect.NewRequest(&adminv1.DeleteUserRequest{Id: u.Id}))
	require.Equal(t, "not_found", codeOf(err))

	audits := ucAuditRows(t, b, u.Id)
	require.Equal(t, []string{"created", "updated", "updated", "blocked", "unblocked", "deleted"}, ucAuditActions(t, b, u.Id))
	for _, a := range audits {
		require.Equal(t, "user", a.ObjectType)
		require.Equal(t, org.Id, a.OrgID)
	}
	require.Empty(t, audits[0].Before)
	require.Contains(t, audits[0].After, `"email":"alice@example.com"`)
	require.Contains(t, audits[1].Before, `"email":"alice@example.com"`)
	require.Contains(t, audits[1].After, `"email":"alice@corp.example"`)
	require.Contains(t, audits[5].Before, `"display_name":"Alice A."`, "the deletion records the last state")
	require.Empty(t, audits[5].After)
	want := []string{"user.upserted", "user.upserted", "user.upserted", "user.blocked", "user.unblocked", "user.deleted"}
	for i := range want {
		want[i] += " " + org.Id + " user"
	}
	require.Equal(t, want, ucOutbox(t, b, u.Id))
}

func TestListUsersPaginates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("acme")
	other := b.mkOrg("other")
	var want []string
	for i := range 5 {
		want = append(want, mkUser(t, b, b.root(), org.Id, fmt.Sprintf("u%d@example.com", i)).Email)
	}
	mkUser(t, b, b.root(), other.Id, "u9@example.com")
	var emails []string
	tok := ""
	for {
		resp, err := b.root().User.ListUsers(ctx, connect.NewRequest(&adminv1.ListUsersRequest{OrgId: org.Id, PageSize: 2, PageToken: tok}))
		require.NoError(t, err)
		for _, u := range resp.Msg.Users {
			emails = append(emails, u.Email)
		}
		if tok = resp.Msg.NextPageToken; tok == "" {
			break
		}
	}
	require.Equal(t, want, emails)
	_, err := b.root().User.ListUsers(ctx, connect.NewRequest(&adminv1.ListUsersRequest{PageSize: -1}))
	require.Equal(t, "invalid_argument", codeOf(err))
}

func TestUserValidation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.root()
	org := b.mkOrg("acme")
	long := strings.Repeat("a", 255-len("@example.com")) + "@example.com"
	bad := []struct {
		name  string
		req   *adminv1.CreateUserRequest
		field string
	}{
		{"no email", &adminv1.CreateUserRequest{OrgId: org.Id}, "email: required"},
		{"no @", &adminv1.CreateUserRequest{OrgId: org.Id, Email: "alice.example.com"}, "email: "},
		{"empty local part", &adminv1.CreateUserRequest{OrgId: org.Id, Email: "@example.com"}, "email: "},
		{"empty domain", &adminv1.CreateUserRequest{OrgId: org.Id, Email: "alice@"}, "email: "},
		{"space", &adminv1.CreateUserRequest{OrgId: org.Id, Email: "al ice@example.com"}, "email: "},
		{"email too long", &adminv1.CreateUserRequest{OrgId: org.Id, Email: long}, "email: must be at most 254"},
		{"display name too long", &adminv1.CreateUserRequest{OrgId: org.Id, Email: "a@b.c", DisplayName: strings.Repeat("x", 201)}, "display_name: "},
		{"negative budget", &adminv1.CreateUserRequest{OrgId: org.Id, Email: "a@b.c",
			Limits: &adminv1.Limits{MaxBudget: proto.Float64(-1), BudgetDuration: "1d"}}, "limits.max_budget: "},
		{"zero tpm", &adminv1.CreateUserRequest{OrgId: org.Id, Email: "a@b.c",
			Limits: &adminv1.Limits{TpmLimit: proto.Int64(0)}}, "limits.tpm_limit: "},
		{"per-model budget", &adminv1.CreateUserRequest{OrgId: org.Id, Email: "a@b.c",
			Limits: &adminv1.Limits{ModelMaxBudget: map[string]float64{"gpt-4o": 5}, BudgetDuration: "1d"}}, "limits.model_max_budget: "},
		{"per-model rpm", &adminv1.CreateUserRequest{OrgId: org.Id, Email: "a@b.c",
			Limits: &adminv1.Limits{ModelRpmLimit: map[string]int64{"gpt-4o": 5}}}, "limits.model_rpm_limit: "},
		{"budget without window", &adminv1.CreateUserRequest{OrgId: org.Id, Email: "a@b.c",
			Limits: &adminv1.Limits{MaxBudget: proto.Float64(10)}}, "limits.budget_duration: required"},
		{"bad window", &adminv1.CreateUserRequest{OrgId: org.Id, Email: "a@b.c",
			Limits: &adminv1.Limits{MaxBudget: proto.Float64(10), BudgetDuration: "1w"}}, "limits.budget_duration: "},
		{"metadata key", &adminv1.CreateUserRequest{OrgId: org.Id, Email: "a@b.c", Metadata: map[string]string{"": "x"}}, "metadata: "},
		{"platform token without org", &adminv1.CreateUserRequest{Email: "a@b.c"}, "org_id: required"},
	}
	n := b.auditCount()
	for _, tc := range bad {
		_, err := c.User.CreateUser(ctx, connect.NewRequest(tc.req))
		require.Equal(t, "invalid_argument", codeOf(err), tc.name)
		require.Contains(t, err.Error(), tc.field, tc.name)
	}
	require.Equal(t, n, b.auditCount(), "rejected requests write nothing")

	ok254 := strings.Repeat("a", 254-len("@example.com")) + "@example.com"
	u := mkUser(t, b, c, org.Id, ok254)
	require.Len(t, u.Email, 254)

	_, err := c.User.CreateUser(ctx, connect.NewRequest(&adminv1.CreateUserRequest{OrgId: "org_missing", Email: "a@b.c"}))
	require.Equal(t, "failed_precondition", codeOf(err))
	require.Contains(t, err.Error(), "org_id does not name an org")

	n = b.auditCount()
	badUpdates := []struct {
		name  string
		user  *adminv1.User
		paths []string
		field string
	}{
		{"no mask", &adminv1.User{Id: u.Id}, nil, "update_mask: required"},
		{"blocked not updatable", &adminv1.User{Id: u.Id, Blocked: true}, []string{"blocked"}, "update_mask: "},
		{"org_id not updatable", &adminv1.User{Id: u.Id, OrgId: "org_x"}, []string{"org_id"}, "update_mask: "},
		{"bad email", &adminv1.User{Id: u.Id, Email: "nope"}, []string{"email"}, "email: "},
		{"zero tpm", &adminv1.User{Id: u.Id, Limits: &adminv1.Limits{TpmLimit: proto.Int64(0)}}, []string{"limits.tpm_limit"}, "limits.tpm_limit: "},
		{"per-model tpm", &adminv1.User{Id: u.Id, Limits: &adminv1.Limits{ModelTpmLimit: map[string]int64{"m": 1}}}, []string{"limits"}, "limits.model_tpm_limit: "},
		{"budget without window", &adminv1.User{Id: u.Id, Limits: &adminv1.Limits{MaxBudget: proto.Float64(3)}}, []string{"limits.max_budget"}, "limits.budget_duration: "},
		{"no id", &adminv1.User{}, []string{"email"}, "user.id: required"},
	}
	for _, tc := range badUpdates {
		_, err := c.User.UpdateUser(ctx, connect.NewRequest(&adminv1.UpdateUserRequest{User: tc.user, UpdateMask: &fieldmaskpb.FieldMask{Paths: tc.paths}}))
		require.Equal(t, "invalid_argument", codeOf(err), tc.name)
		require.Contains(t, err.Error(), tc.field, tc.name)
	}
	require.Equal(t, n, b.auditCount(), "rejected updates write nothing")
	got, err := c.User.GetUser(ctx, connect.NewRequest(&adminv1.GetUserRequest{Id: u.Id}))
	require.NoError(t, err)
	require.True(t, proto.Equal(u, got.Msg.User), "rejected updates change nothing")
}

func TestUserDuplicateEmail(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.root()
	org := b.mkOrg("acme")
	other := b.mkOrg("other")
	mkUser(t, b, c, org.Id, "alice@example.com")
	n := b.auditCount()
	_, err := c.User.CreateUser(ctx, connect.NewRequest(&adminv1.CreateUserRequest{OrgId: org.Id, Email: "ALICE@example.com"}))
	require.Equal(t, "already_exists", codeOf(err))
	require.Contains(t, err.Error(), "a user with this email already exists in the org")
	require.Equal(t, n, b.auditCount())

	mkUser(t, b, c, other.Id, "alice@example.com") // emails are unique per org only
	bob := mkUser(t, b, c, org.Id, "bob@example.com")
	_, err = c.User.UpdateUser(ctx, connect.NewRequest(&adminv1.UpdateUserRequest{
		User: &adminv1.User{Id: bob.Id, Email: "Alice@Example.com"}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"email"}},
	}))
	require.Equal(t, "already_exists", codeOf(err))
	require.Contains(t, err.Error(), "a user with this email already exists in the org")
}

func TestUserCrossOrgIsolation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	orgA, orgB := b.mkOrg("a"), b.mkOrg("b")
	ua := mkUser(t, b, b.root(), orgA.Id, "a@a.example")
	ub := mkUser(t, b, b.root(), orgB.Id, "b@b.example")
	cb := b.as(b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, orgB.Id, ""))
	n := b.auditCount()

	_, err := cb.User.GetUser(ctx, connect.NewRequest(&adminv1.GetUserRequest{Id: ua.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.User.UpdateUser(ctx, connect.NewRequest(&adminv1.UpdateUserRequest{
		User: &adminv1.User{Id: ua.Id, DisplayName: "pwned"}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"display_name"}},
	}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.User.DeleteUser(ctx, connect.NewRequest(&adminv1.DeleteUserRequest{Id: ua.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.User.BlockUser(ctx, connect.NewRequest(&adminv1.BlockUserRequest{Id: ua.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.User.UnblockUser(ctx, connect.NewRequest(&adminv1.UnblockUserRequest{Id: ua.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.User.ListUsers(ctx, connect.NewRequest(&adminv1.ListUsersRequest{OrgId: orgA.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = cb.User.CreateUser(ctx, connect.NewRequest(&adminv1.CreateUserRequest{OrgId: orgA.Id, Email: "x@a.example"}))
	require.Equal(t, "permission_denied", codeOf(err))
	require.Equal(t, n, b.auditCount(), "refused calls write nothing")

	list, err := cb.User.ListUsers(ctx, connect.NewRequest(&adminv1.ListUsersRequest{}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Users, 1, "an org token lists its own org only")
	require.Equal(t, ub.Id, list.Msg.Users[0].Id)
	list, err = cb.User.ListUsers(ctx, connect.NewRequest(&adminv1.ListUsersRequest{OrgId: orgB.Id}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Users, 1)

	// Org B's token works on its own org, defaulting org_id.
	created, err := cb.User.CreateUser(ctx, connect.NewRequest(&adminv1.CreateUserRequest{Email: "c@b.example"}))
	require.NoError(t, err)
	require.Equal(t, orgB.Id, created.Msg.User.OrgId)

	got, err := b.root().User.GetUser(ctx, connect.NewRequest(&adminv1.GetUserRequest{Id: ua.Id}))
	require.NoError(t, err)
	require.True(t, proto.Equal(ua, got.Msg.User), "org A's user is untouched")
	require.Equal(t, []string{"created"}, ucAuditActions(t, b, ua.Id))
}

func TestUserTeamTokenDenied(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("acme")
	team := ucMkTeam(t, b, org.Id, "research")
	u := mkUser(t, b, b.root(), org.Id, "a@example.com")
	ucExec(t, b, `INSERT INTO team_members (team_id, user_id, org_id, created_at, updated_at) VALUES ($1, $2, $3, now(), now())`, team, u.Id, org.Id)
	ct := b.as(b.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_ADMIN, org.Id, team))
	n := b.auditCount()

	_, err := ct.User.CreateUser(ctx, connect.NewRequest(&adminv1.CreateUserRequest{Email: "b@example.com"}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.User.CreateUser(ctx, connect.NewRequest(&adminv1.CreateUserRequest{OrgId: org.Id, Email: "b@example.com"}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.User.GetUser(ctx, connect.NewRequest(&adminv1.GetUserRequest{Id: u.Id}))
	require.Equal(t, "permission_denied", codeOf(err), "even a member of the token's team")
	_, err = ct.User.GetUser(ctx, connect.NewRequest(&adminv1.GetUserRequest{Id: "user_missing"}))
	require.Equal(t, "permission_denied", codeOf(err), "a team token cannot probe for ids")
	_, err = ct.User.ListUsers(ctx, connect.NewRequest(&adminv1.ListUsersRequest{}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.User.UpdateUser(ctx, connect.NewRequest(&adminv1.UpdateUserRequest{
		User: &adminv1.User{Id: u.Id, DisplayName: "x"}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"display_name"}},
	}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.User.BlockUser(ctx, connect.NewRequest(&adminv1.BlockUserRequest{Id: u.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.User.UnblockUser(ctx, connect.NewRequest(&adminv1.UnblockUserRequest{Id: u.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.User.DeleteUser(ctx, connect.NewRequest(&adminv1.DeleteUserRequest{Id: u.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	require.Equal(t, n, b.auditCount())
}

func TestUserViewerCannotMutate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("acme")
	u := mkUser(t, b, b.root(), org.Id, "a@example.com")
	cv := b.as(b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_VIEWER, org.Id, ""))
	n := b.auditCount()

	got, err := cv.User.GetUser(ctx, connect.NewRequest(&adminv1.GetUserRequest{Id: u.Id}))
	require.NoError(t, err)
	require.Equal(t, u.Id, got.Msg.User.Id)
	list, err := cv.User.ListUsers(ctx, connect.NewRequest(&adminv1.ListUsersRequest{}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Users, 1)

	_, err = cv.User.CreateUser(ctx, connect.NewRequest(&adminv1.CreateUserRequest{Email: "b@example.com"}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = cv.User.UpdateUser(ctx, connect.NewRequest(&adminv1.UpdateUserRequest{
		User: &adminv1.User{Id: u.Id, DisplayName: "x"}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"display_name"}},
	}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = cv.User.BlockUser(ctx, connect.NewRequest(&adminv1.BlockUserRequest{Id: u.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = cv.User.UnblockUser(ctx, connect.NewRequest(&adminv1.UnblockUserRequest{Id: u.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = cv.User.DeleteUser(ctx, connect.NewRequest(&adminv1.DeleteUserRequest{Id: u.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	require.Equal(t, n, b.auditCount())

	ce := b.as(b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_EDITOR, org.Id, ""))
	_, err = ce.User.BlockUser(ctx, connect.NewRequest(&adminv1.BlockUserRequest{Id: u.Id}))
	require.NoError(t, err, "editors may change users")
}

func TestDeleteUserWithKeysFails(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.root()
	org := b.mkOrg("acme")
	u := mkUser(t, b, c, org.Id, "a@example.com")
	team := ucMkTeam(t, b, org.Id, "research")
	ucExec(t, b, `INSERT INTO team_members (team_id, user_id, org_id, created_at, updated_at) VALUES ($1, $2, $3, now(), now())`, team, u.Id, org.Id)
	k1 := ucMkKey(t, b, org.Id, u.Id)
	ucMkKey(t, b, org.Id, u.Id)
	n := b.auditCount()

	_, err := c.User.DeleteUser(ctx, connect.NewRequest(&adminv1.DeleteUserRequest{Id: u.Id}))
	require.Equal(t, "failed_precondition", codeOf(err))
	require.Contains(t, err.Error(), "still owns 2 keys")
	ucExec(t, b, `DELETE FROM keys WHERE id = $1`, k1)
	_, err = c.User.DeleteUser(ctx, connect.NewRequest(&adminv1.DeleteUserRequest{Id: u.Id}))
	require.Equal(t, "failed_precondition", codeOf(err))
	require.Contains(t, err.Error(), "still owns 1 key;")
	require.Equal(t, n, b.auditCount(), "refused deletions write nothing")
	require.Equal(t, []string{"user.upserted " + org.Id + " user"}, ucOutbox(t, b, u.Id))

	ucExec(t, b, `DELETE FROM keys WHERE user_id = $1`, u.Id)
	ucOneAudit(t, b, func() error {
		_, err := c.User.DeleteUser(ctx, connect.NewRequest(&adminv1.DeleteUserRequest{Id: u.Id}))
		return err
	})
	var members int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM team_members WHERE user_id = $1`, u.Id).Scan(&members))
	require.Zero(t, members, "memberships go with the user")
	var payload string
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT payload::text FROM outbox WHERE object_id = $1 AND kind = 'user.deleted'`, u.Id).Scan(&payload))
	require.JSONEq(t, `{"team_ids": ["`+team+`"]}`, payload)
}
