package admin

import (
	"context"
	"crypto/rand"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/internal/ids"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// teamEnv wraps a bundle with the helpers the team tests share. It tracks
// the audit and outbox rows seen so far, so that each mutation can be
// checked to write exactly one audit row and the expected outbox rows.
type teamEnv struct {
	*bundle
	ctx        context.Context
	auditSeen  int64
	outboxSeen int64
}

func newTeamEnv(t *testing.T) *teamEnv {
	return &teamEnv{bundle: setup(t), ctx: context.Background()}
}

// team creates a team in org with the bootstrap token.
func (e *teamEnv) team(orgID, name string) *adminv1.Team {
	e.t.Helper()
	resp, err := e.root().Team.CreateTeam(e.ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: orgID, Name: name}))
	require.NoError(e.t, err)
	return resp.Msg.Team
}

// user inserts a user of org with plain SQL and returns its id.
func (e *teamEnv) user(orgID, email string) string {
	e.t.Helper()
	id := ids.New(ids.User)
	_, err := e.pool.Exec(e.ctx, `INSERT INTO users (id, org_id, email, created_at, updated_at) VALUES ($1, $2, $3, now(), now())`,
		id, orgID, email)
	require.NoError(e.t, err)
	return id
}

// key inserts a virtual key of team with plain SQL and returns its id.
func (e *teamEnv) key(orgID, teamID string) string {
	e.t.Helper()
	id := ids.New(ids.Key)
	hash := make([]byte, 32)
	_, _ = rand.Read(hash)
	_, err := e.pool.Exec(e.ctx, `INSERT INTO keys (id, org_id, team_id, token_hash, pepper_version, display_prefix, last4, created_at, updated_at)
		VALUES ($1, $2, $3, $4, 1, 'sk-sl-test', 'abcd', now(), now())`, id, orgID, teamID, hash)
	require.NoError(e.t, err)
	return id
}

// outboxKinds returns the kinds of all outbox rows in sequence order.
func (e *teamEnv) outboxKinds() []string {
	e.t.Helper()
	rows, err := e.pool.Query(e.ctx, `SELECT kind FROM outbox ORDER BY seq`)
	require.NoError(e.t, err)
	defer rows.Close()
	var kinds []string
	for rows.Next() {
		var k string
		require.NoError(e.t, rows.Scan(&k))
		kinds = append(kinds, k)
	}
	require.NoError(e.t, rows.Err())
	return kinds
}

// sync marks every audit and outbox row written so far as seen.
func (e *teamEnv) sync() {
	e.t.Helper()
	e.auditSeen = e.auditCount()
	e.outboxSeen = int64(len(e.outboxKinds()))
}

// wrote asserts that exactly one audit row and the outbox rows of kinds
// (in order) were written since the last check.
func (e *teamEnv) wrote(kinds ...string) {
	e.t.Helper()
	require.Equal(e.t, e.auditSeen+1, e.auditCount(), "a mutation writes exactly one audit row")
	all := e.outboxKinds()
	require.Equal(e.t, kinds, append([]string{}, all[e.outboxSeen:]...), "outbox rows of the mutation")
	e.sync()
}

// wroteNothing asserts that no audit or outbox row was written since the
// last check (a refused or failed call).
func (e *teamEnv) wroteNothing() {
	e.t.Helper()
	require.Equal(e.t, e.auditSeen, e.auditCount(), "a failed call writes no audit row")
	require.Len(e.t, e.outboxKinds(), int(e.outboxSeen), "a failed call writes no outbox row")
}

type teamAuditRow struct {
	Action, ObjectType, ObjectID, OrgID, TeamID string
	HasBefore, HasAfter                         bool
}

// lastAudit returns the newest audit row.
func (e *teamEnv) lastAudit() teamAuditRow {
	e.t.Helper()
	var r teamAuditRow
	require.NoError(e.t, e.pool.QueryRow(e.ctx, `SELECT action, object_type, object_id, org_id, team_id,
		before_json <> '', after_json <> '' FROM audit_log ORDER BY seq DESC LIMIT 1`).
		Scan(&r.Action, &r.ObjectType, &r.ObjectID, &r.OrgID, &r.TeamID, &r.HasBefore, &r.HasAfter))
	return r
}

func updateMask(paths ...string) *fieldmaskpb.FieldMask { return &fieldmaskpb.FieldMask{Paths: paths} }

func TestTeamLifecycle(t *testing.T) {
	t.Parallel()
	e := newTeamEnv(t)
	ctx := e.ctx
	c := e.root()
	org := e.mkOrg("acme")
	e.sync()

	_, err := c.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{Name: "research"}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.Contains(t, err.Error(), "org_id", "a platform token must name the org")
	_, err = c.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: ids.New(ids.Org), Name: "research"}))
	require.Equal(t, "not_found", codeOf(err))
	e.wroteNothing()

	created, err := c.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{
		OrgId: org.Id, Name: "research",
		Limits: &adminv1.Limits{
			MaxBudget: proto.Float64(500), BudgetDuration: "1mo", RpmLimit: proto.Int64(600),
			AllowedModels: []string{"qwen-30b"}, ModelRpmLimit: map[string]int64{"qwen-30b": 100},
			ModelMaxBudget: map[string]float64{"qwen-30b": 50},
		},
		Metadata:          map[string]string{"cost_center": "r&d"},
		TrafficClass:      adminv1.TrafficClass_TRAFFIC_CLASS_AGENT,
		ModelGroupAliases: map[string]string{"qwen-30b": "qwen-30b-agents"},
	}))
	require.NoError(t, err)
	team := created.Msg.Team
	require.True(t, strings.HasPrefix(team.Id, "team_"))
	require.Equal(t, org.Id, team.OrgId)
	require.False(t, team.Blocked)
	e.wrote("team.upserted")
	require.Equal(t, teamAuditRow{Action: "created", ObjectType: "team", ObjectID: team.Id, OrgID: org.Id, TeamID: team.Id, HasAfter: true}, e.lastAudit())

	var tc string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT traffic_class FROM teams WHERE id = $1`, team.Id).Scan(&tc))
	require.Equal(t, "agent", tc, "traffic class is stored by name")

	got, err := c.Team.GetTeam(ctx, connect.NewRequest(&adminv1.GetTeamRequest{Id: team.Id}))
	require.NoError(t, err)
	require.True(t, proto.Equal(team, got.Msg.Team), "get returns what create stored:\n%v\n%v", team, got.Msg.Team)

	_, err = c.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: org.Id, Name: "research"}))
	require.Equal(t, "already_exists", codeOf(err))
	e.wroteNothing()

	upd, err := c.Team.UpdateTeam(ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{
		Team: &adminv1.Team{Id: team.Id, Name: "ignored", Limits: &adminv1.Limits{RpmLimit: proto.Int64(1200)},
			TrafficClass: adminv1.TrafficClass_TRAFFIC_CLASS_BATCH},
		UpdateMask: updateMask("limits.rpm_limit", "traffic_class", "model_group_aliases"),
	}))
	require.NoError(t, err)
	require.Equal(t, int64(1200), upd.Msg.Team.Limits.GetRpmLimit())
	require.Equal(t, 500.0, upd.Msg.Team.Limits.GetMaxBudget(), "fields outside the mask are kept")
	require.Equal(t, "research", upd.Msg.Team.Name, "fields outside the mask are kept")
	require.Equal(t, adminv1.TrafficClass_TRAFFIC_CLASS_BATCH, upd.Msg.Team.TrafficClass)
	require.Empty(t, upd.Msg.Team.ModelGroupAliases, "a masked field absent from the request is cleared")
	e.wrote("team.upserted")
	require.Equal(t, teamAuditRow{Action: "updated", ObjectType: "team", ObjectID: team.Id, OrgID: org.Id, TeamID: team.Id, HasBefore: true, HasAfter: true}, e.lastAudit())

	got, err = c.Team.GetTeam(ctx, connect.NewRequest(&adminv1.GetTeamRequest{Id: team.Id}))
	require.NoError(t, err)
	require.True(t, proto.Equal(upd.Msg.Team, got.Msg.Team), "the update was stored:\n%v\n%v", upd.Msg.Team, got.Msg.Team)

	for _, p := range []string{"blocked", "org_id", "id"} {
		_, err = c.Team.UpdateTeam(ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{Team: &adminv1.Team{Id: team.Id}, UpdateMask: updateMask(p)}))
		require.Equal(t, "invalid_argument", codeOf(err), p)
		require.Contains(t, err.Error(), "update_mask", p)
	}
	e.wroteNothing()

	bl, err := c.Team.BlockTeam(ctx, connect.NewRequest(&adminv1.BlockTeamRequest{Id: team.Id}))
	require.NoError(t, err)
	require.True(t, bl.Msg.Team.Blocked)
	e.wrote("team.blocked")
	require.Equal(t, "blocked", e.lastAudit().Action)

	other := e.team(org.Id, "support")
	e.sync()
	list, err := c.Team.ListTeams(ctx, connect.NewRequest(&adminv1.ListTeamsRequest{OrgId: org.Id, Blocked: proto.Bool(true)}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Teams, 1)
	require.Equal(t, team.Id, list.Msg.Teams[0].Id)
	list, err = c.Team.ListTeams(ctx, connect.NewRequest(&adminv1.ListTeamsRequest{NamePrefix: "sup"}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Teams, 1)
	require.Equal(t, other.Id, list.Msg.Teams[0].Id)

	ub, err := c.Team.UnblockTeam(ctx, connect.NewRequest(&adminv1.UnblockTeamRequest{Id: team.Id}))
	require.NoError(t, err)
	require.False(t, ub.Msg.Team.Blocked)
	e.wrote("team.unblocked")
	require.Equal(t, "unblocked", e.lastAudit().Action)

	_, err = c.Team.DeleteTeam(ctx, connect.NewRequest(&adminv1.DeleteTeamRequest{Id: team.Id}))
	require.NoError(t, err)
	e.wrote("team.deleted")
	require.Equal(t, teamAuditRow{Action: "deleted", ObjectType: "team", ObjectID: team.Id, OrgID: org.Id, TeamID: team.Id, HasBefore: true}, e.lastAudit())
	_, err = c.Team.GetTeam(ctx, connect.NewRequest(&adminv1.GetTeamRequest{Id: team.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = c.Team.DeleteTeam(ctx, connect.NewRequest(&adminv1.DeleteTeamRequest{Id: team.Id}))
	require.Equal(t, "not_found", codeOf(err))
	e.wroteNothing()

	require.Equal(t, []string{"org.upserted", "team.upserted", "team.upserted", "team.blocked", "team.upserted", "team.unblocked", "team.deleted"}, e.outboxKinds())
}

func TestListTeamsPaginates(t *testing.T) {
	t.Parallel()
	e := newTeamEnv(t)
	org := e.mkOrg("acme")
	for _, n := range []string{"a", "b", "c", "d", "e"} {
		e.team(org.Id, n)
	}
	var names []string
	tok := ""
	for {
		resp, err := e.root().Team.ListTeams(e.ctx, connect.NewRequest(&adminv1.ListTeamsRequest{OrgId: org.Id, PageSize: 2, PageToken: tok}))
		require.NoError(t, err)
		for _, tm := range resp.Msg.Teams {
			names = append(names, tm.Name)
		}
		if tok = resp.Msg.NextPageToken; tok == "" {
			break
		}
	}
	require.Equal(t, []string{"a", "b", "c", "d", "e"}, names)
	_, err := e.root().Team.ListTeams(e.ctx, connect.NewRequest(&adminv1.ListTeamsRequest{PageToken: "!!"}))
	require.Equal(t, "invalid_argument", codeOf(err))
}

func TestCreateTeamValidation(t *testing.T) {
	t.Parallel()
	e := newTeamEnv(t)
	org := e.mkOrg("acme")
	e.sync()
	cases := []struct {
		name  string
		req   *adminv1.CreateTeamRequest
		field string
	}{
		{"rpm zero", &adminv1.CreateTeamRequest{Name: "t", Limits: &adminv1.Limits{RpmLimit: proto.Int64(0)}}, "limits.rpm_limit"},
		{"tpm negative", &adminv1.CreateTeamRequest{Name: "t", Limits: &adminv1.Limits{TpmLimit: proto.Int64(-1)}}, "limits.tpm_limit"},
		{"parallel too high", &adminv1.CreateTeamRequest{Name: "t", Limits: &adminv1.Limits{MaxParallelRequests: proto.Int64(1e7)}}, "limits.max_parallel_requests"},
		{"bad window", &adminv1.CreateTeamRequest{Name: "t", Limits: &adminv1.Limits{MaxBudget: proto.Float64(10), BudgetDuration: "5x"}}, "limits.budget_duration"},
		{"budget without window", &adminv1.CreateTeamRequest{Name: "t", Limits: &adminv1.Limits{MaxBudget: proto.Float64(10)}}, "limits.budget_duration"},
		{"soft above hard", &adminv1.CreateTeamRequest{Name: "t", Limits: &adminv1.Limits{MaxBudget: proto.Float64(10), SoftBudget: proto.Float64(20), BudgetDuration: "1d"}}, "limits.soft_budget"},
		{"negative budget", &adminv1.CreateTeamRequest{Name: "t", Limits: &adminv1.Limits{MaxBudget: proto.Float64(-1), BudgetDuration: "1d"}}, "limits.max_budget"},
		{"model rpm zero", &adminv1.CreateTeamRequest{Name: "t", Limits: &adminv1.Limits{ModelRpmLimit: map[string]int64{"m": 0}}}, "limits.model_rpm_limit[m]"},
		{"duplicate model", &adminv1.CreateTeamRequest{Name: "t", Limits: &adminv1.Limits{AllowedModels: []string{"m", "m"}}}, "limits.allowed_models[1]"},
		{"no name", &adminv1.CreateTeamRequest{Name: " "}, "name"},
		{"long name", &adminv1.CreateTeamRequest{Name: strings.Repeat("x", 101)}, "name"},
		{"traffic class", &adminv1.CreateTeamRequest{Name: "t", TrafficClass: adminv1.TrafficClass(42)}, "traffic_class"},
		{"alias target", &adminv1.CreateTeamRequest{Name: "t", ModelGroupAliases: map[string]string{"a": " b"}}, "model_group_aliases[a]"},
		{"metadata key", &adminv1.CreateTeamRequest{Name: "t", Metadata: map[string]string{"": "v"}}, "metadata"},
	}
	for _, tc := range cases {
		tc.req.OrgId = org.Id
		_, err := e.root().Team.CreateTeam(e.ctx, connect.NewRequest(tc.req))
		require.Equal(t, "invalid_argument", codeOf(err), tc.name)
		require.Contains(t, err.Error(), tc.field+":", tc.name)
	}
	e.wroteNothing()

	team := e.team(org.Id, "t")
	e.sync()
	_, err := e.root().Team.UpdateTeam(e.ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{
		Team: &adminv1.Team{Id: team.Id, Limits: &adminv1.Limits{RpmLimit: proto.Int64(0)}}, UpdateMask: updateMask("limits.rpm_limit"),
	}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.Contains(t, err.Error(), "limits.rpm_limit:")
	_, err = e.root().Team.UpdateTeam(e.ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{
		Team: &adminv1.Team{Id: team.Id, Name: "t2"},
	}))
	require.Equal(t, "invalid_argument", codeOf(err), "an update needs a mask")
	require.Contains(t, err.Error(), "update_mask")
	e.wroteNothing()
}

func TestTeamMemberValidation(t *testing.T) {
	t.Parallel()
	e := newTeamEnv(t)
	org := e.mkOrg("acme")
	team := e.team(org.Id, "research")
	user := e.user(org.Id, "ada@example.com")
	e.sync()
	cases := []struct {
		name  string
		req   *adminv1.AddTeamMemberRequest
		field string
	}{
		{"model rpm on member", &adminv1.AddTeamMemberRequest{Limits: &adminv1.Limits{ModelRpmLimit: map[string]int64{"m": 5}}}, "limits.model_rpm_limit"},
		{"model budget on member", &adminv1.AddTeamMemberRequest{Limits: &adminv1.Limits{ModelMaxBudget: map[string]float64{"m": 5}, BudgetDuration: "1d"}}, "limits.model_max_budget"},
		{"max_budget on member", &adminv1.AddTeamMemberRequest{Limits: &adminv1.Limits{MaxBudget: proto.Float64(5), BudgetDuration: "1d"}}, "limits.max_budget"},
		{"allowed models on member", &adminv1.AddTeamMemberRequest{Limits: &adminv1.Limits{AllowedModels: []string{"m"}}}, "limits.allowed_models"},
		{"zero member budget", &adminv1.AddTeamMemberRequest{MaxBudgetInTeam: proto.Float64(0), Limits: &adminv1.Limits{BudgetDuration: "1d"}}, "max_budget_in_team"},
		{"member budget without window", &adminv1.AddTeamMemberRequest{MaxBudgetInTeam: proto.Float64(10)}, "limits.budget_duration"},
		{"soft above member budget", &adminv1.AddTeamMemberRequest{MaxBudgetInTeam: proto.Float64(10), Limits: &adminv1.Limits{SoftBudget: proto.Float64(11), BudgetDuration: "1d"}}, "limits.soft_budget"},
		{"rpm zero", &adminv1.AddTeamMemberRequest{Limits: &adminv1.Limits{RpmLimit: proto.Int64(0)}}, "limits.rpm_limit"},
	}
	for _, tc := range cases {
		tc.req.TeamId, tc.req.UserId = team.Id, user
		_, err := e.root().Team.AddTeamMember(e.ctx, connect.NewRequest(tc.req))
		require.Equal(t, "invalid_argument", codeOf(err), tc.name)
		require.Contains(t, err.Error(), tc.field+":", tc.name)
	}
	_, err := e.root().Team.AddTeamMember(e.ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: team.Id}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.Contains(t, err.Error(), "user_id: required")
	e.wroteNothing()

	_, err = e.root().Team.AddTeamMember(e.ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: team.Id, UserId: user}))
	require.NoError(t, err)
	e.sync()
	_, err = e.root().Team.UpdateTeamMember(e.ctx, connect.NewRequest(&adminv1.UpdateTeamMemberRequest{
		Member:     &adminv1.TeamMember{TeamId: team.Id, UserId: user, Limits: &adminv1.Limits{ModelTpmLimit: map[string]int64{"m": 5}}},
		UpdateMask: updateMask("limits.model_tpm_limit"),
	}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.Contains(t, err.Error(), "limits.model_tpm_limit:")
	_, err = e.root().Team.UpdateTeamMember(e.ctx, connect.NewRequest(&adminv1.UpdateTeamMemberRequest{
		Member: &adminv1.TeamMember{TeamId: team.Id, UserId: user, OrgId: "org_x"}, UpdateMask: updateMask("org_id"),
	}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.Contains(t, err.Error(), "update_mask")
	e.wroteNothing()
}

func TestTeamMembers(t *testing.T) {
	t.Parallel()
	e := newTeamEnv(t)
	ctx := e.ctx
	c := e.root()
	org := e.mkOrg("acme")
	otherOrg := e.mkOrg("globex")
	team := e.team(org.Id, "research")
	ada := e.user(org.Id, "ada@example.com")
	bob := e.user(org.Id, "bob@example.com")
	stranger := e.user(otherOrg.Id, "eve@example.com")
	e.sync()

	added, err := c.Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{
		TeamId: team.Id, UserId: ada, MaxBudgetInTeam: proto.Float64(25),
		Limits: &adminv1.Limits{BudgetDuration: "7d", SoftBudget: proto.Float64(20), RpmLimit: proto.Int64(60)},
	}))
	require.NoError(t, err)
	m := added.Msg.Member
	require.Equal(t, team.Id, m.TeamId)
	require.Equal(t, ada, m.UserId)
	require.Equal(t, org.Id, m.OrgId)
	require.Equal(t, 25.0, m.GetMaxBudgetInTeam())
	require.Equal(t, int64(60), m.Limits.GetRpmLimit())
	e.wrote("member.upserted")
	require.Equal(t, teamAuditRow{Action: "member_added", ObjectType: "team_member", ObjectID: team.Id + "/" + ada, OrgID: org.Id, TeamID: team.Id, HasAfter: true}, e.lastAudit())
	var payload string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT object_type || ' ' || object_id || ' ' || org_id || ' ' || (payload->>'user_id') FROM outbox ORDER BY seq DESC LIMIT 1`).Scan(&payload))
	require.Equal(t, "team_member "+team.Id+"/"+ada+" "+org.Id+" "+ada, payload)
	var stored float64
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT max_budget_in_team FROM team_members WHERE team_id = $1 AND user_id = $2`, team.Id, ada).Scan(&stored))
	require.Equal(t, 25.0, stored)

	_, err = c.Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: team.Id, UserId: ada}))
	require.Equal(t, "already_exists", codeOf(err))
	_, err = c.Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: team.Id, UserId: stranger}))
	require.Equal(t, "not_found", codeOf(err), "a user of another org cannot join")
	require.Contains(t, err.Error(), "user "+stranger+" not found")
	missing := ids.New(ids.User)
	_, err = c.Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: team.Id, UserId: missing}))
	require.Equal(t, "not_found", codeOf(err))
	require.Contains(t, err.Error(), "user "+missing+" not found")
	_, err = c.Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: ids.New(ids.Team), UserId: ada}))
	require.Equal(t, "not_found", codeOf(err))
	e.wroteNothing()

	_, err = c.Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: team.Id, UserId: bob}))
	require.NoError(t, err)
	e.wrote("member.upserted")

	upd, err := c.Team.UpdateTeamMember(ctx, connect.NewRequest(&adminv1.UpdateTeamMemberRequest{
		Member:     &adminv1.TeamMember{TeamId: team.Id, UserId: ada, MaxBudgetInTeam: proto.Float64(40), Limits: &adminv1.Limits{RpmLimit: proto.Int64(120)}},
		UpdateMask: updateMask("max_budget_in_team", "limits.rpm_limit"),
	}))
	require.NoError(t, err)
	require.Equal(t, 40.0, upd.Msg.Member.GetMaxBudgetInTeam())
	require.Equal(t, int64(120), upd.Msg.Member.Limits.GetRpmLimit())
	require.Equal(t, 20.0, upd.Msg.Member.Limits.GetSoftBudget(), "fields outside the mask are kept")
	e.wrote("member.upserted")
	require.Equal(t, teamAuditRow{Action: "member_updated", ObjectType: "team_member", ObjectID: team.Id + "/" + ada, OrgID: org.Id, TeamID: team.Id, HasBefore: true, HasAfter: true}, e.lastAudit())

	// Clearing the member budget (and the soft budget that needs a window).
	upd, err = c.Team.UpdateTeamMember(ctx, connect.NewRequest(&adminv1.UpdateTeamMemberRequest{
		Member: &adminv1.TeamMember{TeamId: team.Id, UserId: ada}, UpdateMask: updateMask("max_budget_in_team", "limits.soft_budget"),
	}))
	require.NoError(t, err)
	require.Nil(t, upd.Msg.Member.MaxBudgetInTeam)
	var null bool
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT max_budget_in_team IS NULL FROM team_members WHERE team_id = $1 AND user_id = $2`, team.Id, ada).Scan(&null))
	require.True(t, null)
	e.wrote("member.upserted")

	_, err = c.Team.UpdateTeamMember(ctx, connect.NewRequest(&adminv1.UpdateTeamMemberRequest{
		Member: &adminv1.TeamMember{TeamId: team.Id, UserId: stranger}, UpdateMask: updateMask("limits"),
	}))
	require.Equal(t, "not_found", codeOf(err))
	require.Contains(t, err.Error(), "is not a member of team")
	e.wroteNothing()

	var members []string
	tok := ""
	for {
		resp, err := c.Team.ListTeamMembers(ctx, connect.NewRequest(&adminv1.ListTeamMembersRequest{TeamId: team.Id, PageSize: 1, PageToken: tok}))
		require.NoError(t, err)
		for _, m := range resp.Msg.Members {
			members = append(members, m.UserId)
		}
		if tok = resp.Msg.NextPageToken; tok == "" {
			break
		}
	}
	want := []string{ada, bob}
	if bob < ada {
		want = []string{bob, ada}
	}
	require.Equal(t, want, members, "members are listed in user id order across pages")

	_, err = c.Team.RemoveTeamMember(ctx, connect.NewRequest(&adminv1.RemoveTeamMemberRequest{TeamId: team.Id, UserId: ada}))
	require.NoError(t, err)
	e.wrote("member.deleted")
	require.Equal(t, teamAuditRow{Action: "member_removed", ObjectType: "team_member", ObjectID: team.Id + "/" + ada, OrgID: org.Id, TeamID: team.Id, HasBefore: true}, e.lastAudit())
	_, err = c.Team.RemoveTeamMember(ctx, connect.NewRequest(&adminv1.RemoveTeamMemberRequest{TeamId: team.Id, UserId: ada}))
	require.Equal(t, "not_found", codeOf(err))
	e.wroteNothing()

	// Deleting the team takes its remaining memberships with it.
	_, err = c.Team.DeleteTeam(ctx, connect.NewRequest(&adminv1.DeleteTeamRequest{Id: team.Id}))
	require.NoError(t, err)
	e.wrote("team.deleted")
	var n int
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT count(*) FROM team_members WHERE team_id = $1`, team.Id).Scan(&n))
	require.Zero(t, n)
}

func TestDeleteTeamWithDependents(t *testing.T) {
	t.Parallel()
	e := newTeamEnv(t)
	ctx := e.ctx
	c := e.root()
	org := e.mkOrg("acme")
	team := e.team(org.Id, "research")
	keyID := e.key(org.Id, team.Id)
	e.sync()

	_, err := c.Team.DeleteTeam(ctx, connect.NewRequest(&adminv1.DeleteTeamRequest{Id: team.Id}))
	require.Equal(t, "failed_precondition", codeOf(err))
	require.Contains(t, err.Error(), "1 keys")
	e.wroteNothing()

	_, err = e.pool.Exec(ctx, `DELETE FROM keys WHERE id = $1`, keyID)
	require.NoError(t, err)
	tokResp, err := c.Token.CreateAdminToken(ctx, connect.NewRequest(&adminv1.CreateAdminTokenRequest{
		Name: "ci", Scope: adminv1.Scope_SCOPE_TEAM, Role: adminv1.Role_ROLE_EDITOR, OrgId: org.Id, TeamId: team.Id,
	}))
	require.NoError(t, err)
	e.sync()
	_, err = c.Team.DeleteTeam(ctx, connect.NewRequest(&adminv1.DeleteTeamRequest{Id: team.Id}))
	require.Equal(t, "failed_precondition", codeOf(err))
	require.Contains(t, err.Error(), "1 admin tokens")
	e.wroteNothing()

	_, err = c.Token.RevokeAdminToken(ctx, connect.NewRequest(&adminv1.RevokeAdminTokenRequest{Id: tokResp.Msg.AdminToken.Id}))
	require.NoError(t, err)
	e.sync()
	_, err = c.Team.DeleteTeam(ctx, connect.NewRequest(&adminv1.DeleteTeamRequest{Id: team.Id}))
	require.NoError(t, err, "revoked admin tokens do not keep a team alive")
	e.wrote("team.deleted")
	var n int
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT count(*) FROM admin_tokens WHERE team_id = $1`, team.Id).Scan(&n))
	require.Zero(t, n, "the team's revoked admin tokens are deleted with it")
}

func TestTeamCrossOrg(t *testing.T) {
	t.Parallel()
	e := newTeamEnv(t)
	ctx := e.ctx
	orgA := e.mkOrg("a")
	orgB := e.mkOrg("b")
	teamA := e.team(orgA.Id, "alpha")
	teamB := e.team(orgB.Id, "beta")
	userA := e.user(orgA.Id, "ada@example.com")
	cb := e.as(e.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, orgB.Id, ""))
	e.sync()

	_, err := cb.Team.GetTeam(ctx, connect.NewRequest(&adminv1.GetTeamRequest{Id: teamA.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.Team.UpdateTeam(ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{Team: &adminv1.Team{Id: teamA.Id, Name: "x"}, UpdateMask: updateMask("name")}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.Team.BlockTeam(ctx, connect.NewRequest(&adminv1.BlockTeamRequest{Id: teamA.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.Team.DeleteTeam(ctx, connect.NewRequest(&adminv1.DeleteTeamRequest{Id: teamA.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: teamA.Id, UserId: userA}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.Team.ListTeamMembers(ctx, connect.NewRequest(&adminv1.ListTeamMembersRequest{TeamId: teamA.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.Team.ListTeams(ctx, connect.NewRequest(&adminv1.ListTeamsRequest{OrgId: orgA.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = cb.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: orgA.Id, Name: "intruder"}))
	require.Equal(t, "permission_denied", codeOf(err))
	e.wroteNothing()

	list, err := cb.Team.ListTeams(ctx, connect.NewRequest(&adminv1.ListTeamsRequest{}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Teams, 1)
	require.Equal(t, teamB.Id, list.Msg.Teams[0].Id)

	created, err := cb.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{Name: "gamma"}))
	require.NoError(t, err)
	require.Equal(t, orgB.Id, created.Msg.Team.OrgId, "org_id defaults to the token's org")
	e.wrote("team.upserted")
}

func TestTeamScopedToken(t *testing.T) {
	t.Parallel()
	e := newTeamEnv(t)
	ctx := e.ctx
	org := e.mkOrg("acme")
	own := e.team(org.Id, "own")
	other := e.team(org.Id, "other")
	user := e.user(org.Id, "ada@example.com")
	ct := e.as(e.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_EDITOR, org.Id, own.Id))
	e.sync()

	got, err := ct.Team.GetTeam(ctx, connect.NewRequest(&adminv1.GetTeamRequest{Id: own.Id}))
	require.NoError(t, err)
	require.Equal(t, own.Id, got.Msg.Team.Id)
	_, err = ct.Team.GetTeam(ctx, connect.NewRequest(&adminv1.GetTeamRequest{Id: other.Id}))
	require.Equal(t, "not_found", codeOf(err))
	list, err := ct.Team.ListTeams(ctx, connect.NewRequest(&adminv1.ListTeamsRequest{OrgId: org.Id}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Teams, 1)
	require.Equal(t, own.Id, list.Msg.Teams[0].Id)

	_, err = ct.Team.UpdateTeam(ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{
		Team: &adminv1.Team{Id: own.Id, Limits: &adminv1.Limits{RpmLimit: proto.Int64(1e6)}}, UpdateMask: updateMask("limits.rpm_limit"),
	}))
	require.Equal(t, "permission_denied", codeOf(err), "a team token cannot raise its own limits")
	_, err = ct.Team.BlockTeam(ctx, connect.NewRequest(&adminv1.BlockTeamRequest{Id: own.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.Team.UnblockTeam(ctx, connect.NewRequest(&adminv1.UnblockTeamRequest{Id: own.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.Team.DeleteTeam(ctx, connect.NewRequest(&adminv1.DeleteTeamRequest{Id: own.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{Name: "new"}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: other.Id, UserId: user}))
	require.Equal(t, "not_found", codeOf(err))
	e.wroteNothing()

	// Its own team's members are the team token's to manage.
	_, err = ct.Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: own.Id, UserId: user}))
	require.NoError(t, err)
	e.wrote("member.upserted")
	_, err = ct.Team.UpdateTeamMember(ctx, connect.NewRequest(&adminv1.UpdateTeamMemberRequest{
		Member: &adminv1.TeamMember{TeamId: own.Id, UserId: user, Limits: &adminv1.Limits{RpmLimit: proto.Int64(10)}}, UpdateMask: updateMask("limits"),
	}))
	require.NoError(t, err)
	e.wrote("member.upserted")
	members, err := ct.Team.ListTeamMembers(ctx, connect.NewRequest(&adminv1.ListTeamMembersRequest{TeamId: own.Id}))
	require.NoError(t, err)
	require.Len(t, members.Msg.Members, 1)
	_, err = ct.Team.RemoveTeamMember(ctx, connect.NewRequest(&adminv1.RemoveTeamMemberRequest{TeamId: own.Id, UserId: user}))
	require.NoError(t, err)
	e.wrote("member.deleted")

	// The team's audit trail (team and member records) is readable by its
	// own token because the records carry team_id.
	events, err := ct.Audit.ListAuditEvents(ctx, connect.NewRequest(&adminv1.ListAuditEventsRequest{}))
	require.NoError(t, err)
	var actions []string
	for _, ev := range events.Msg.Events {
		require.Equal(t, own.Id, ev.TeamId)
		actions = append(actions, ev.Action)
	}
	require.Contains(t, actions, "created")
	require.Contains(t, actions, "member_added")
	require.Contains(t, actions, "member_updated")
	require.Contains(t, actions, "member_removed")
}

func TestTeamViewerCannotMutate(t *testing.T) {
	t.Parallel()
	e := newTeamEnv(t)
	ctx := e.ctx
	org := e.mkOrg("acme")
	team := e.team(org.Id, "research")
	user := e.user(org.Id, "ada@example.com")
	_, err := e.root().Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: team.Id, UserId: user}))
	require.NoError(t, err)
	orgViewer := e.as(e.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_VIEWER, org.Id, ""))
	teamViewer := e.as(e.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_VIEWER, org.Id, team.Id))
	e.sync()

	for _, v := range []clients{orgViewer, teamViewer} {
		_, err = v.Team.GetTeam(ctx, connect.NewRequest(&adminv1.GetTeamRequest{Id: team.Id}))
		require.NoError(t, err, "viewers read")
		_, err = v.Team.ListTeamMembers(ctx, connect.NewRequest(&adminv1.ListTeamMembersRequest{TeamId: team.Id}))
		require.NoError(t, err, "viewers read")

		_, err = v.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{Name: "new"}))
		require.Equal(t, "permission_denied", codeOf(err))
		_, err = v.Team.UpdateTeam(ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{Team: &adminv1.Team{Id: team.Id, Name: "x"}, UpdateMask: updateMask("name")}))
		require.Equal(t, "permission_denied", codeOf(err))
		_, err = v.Team.BlockTeam(ctx, connect.NewRequest(&adminv1.BlockTeamRequest{Id: team.Id}))
		require.Equal(t, "permission_denied", codeOf(err))
		_, err = v.Team.DeleteTeam(ctx, connect.NewRequest(&adminv1.DeleteTeamRequest{Id: team.Id}))
		require.Equal(t, "permission_denied", codeOf(err))
		_, err = v.Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: team.Id, UserId: user}))
		require.Equal(t, "permission_denied", codeOf(err))
		_, err = v.Team.UpdateTeamMember(ctx, connect.NewRequest(&adminv1.UpdateTeamMemberRequest{
			Member: &adminv1.TeamMember{TeamId: team.Id, UserId: user}, UpdateMask: updateMask("limits"),
		}))
		require.Equal(t, "permission_denied", codeOf(err))
		_, err = v.Team.RemoveTeamMember(ctx, connect.NewRequest(&adminv1.RemoveTeamMemberRequest{TeamId: team.Id, UserId: user}))
		require.Equal(t, "permission_denied", codeOf(err))
	}
	e.wroteNothing()
}
