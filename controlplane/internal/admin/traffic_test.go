package admin

import (
	"context"
	"net/http"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

const (
	tcInteractive = adminv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE
	tcAgent       = adminv1.TrafficClass_TRAFFIC_CLASS_AGENT
	tcBatch       = adminv1.TrafficClass_TRAFFIC_CLASS_BATCH
)

// traffic returns a TrafficService client for tok on the bundle's server.
func (b *bundle) traffic(tok string) adminv1connect.TrafficServiceClient {
	return adminv1connect.NewTrafficServiceClient(http.DefaultClient, b.url, connect.WithInterceptors(bearer(tok)))
}

// outboxKinds returns the kinds of the outbox rows of one object, in order.
func (b *bundle) outboxKinds(objectType, objectID string) []string {
	b.t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT kind FROM outbox WHERE object_type = $1 AND object_id = $2 ORDER BY seq`, objectType, objectID)
	require.NoError(b.t, err)
	defer rows.Close()
	var out []string
	for rows.Next() {
		var k string
		require.NoError(b.t, rows.Scan(&k))
		out = append(out, k)
	}
	require.NoError(b.t, rows.Err())
	return out
}

func (b *bundle) auditOf(objectType, objectID string) int {
	b.t.Helper()
	var n int
	require.NoError(b.t, b.pool.QueryRow(context.Background(),
		`SELECT count(*) FROM audit_log WHERE object_type = $1 AND object_id = $2 AND action = 'updated'`, objectType, objectID).Scan(&n))
	return n
}

func requireProto(t *testing.T, want, got proto.Message) {
	t.Helper()
	require.True(t, proto.Equal(want, got), "want %v\ngot  %v", want, got)
}

func i32(v int32) *int32 { return &v }

func TestOrgTraffic(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("traffic-org")
	tr := b.traffic(b.bootstrap)

	got, err := tr.GetOrgTraffic(ctx, connect.NewRequest(&adminv1.GetOrgTrafficRequest{OrgId: org.Id}))
	require.NoError(t, err)
	require.True(t, proto.Equal(&adminv1.OrgTraffic{}, got.Msg.Traffic), "nothing set: %v", got.Msg.Traffic)

	want := &adminv1.OrgTraffic{
		DefaultClass: tcInteractive,
		Rules: []*adminv1.ClassificationRule{
			{Header: "User-Agent", Pattern: `^claude-code/`, TrafficClass: tcAgent},
			{Header: "X-Job", Pattern: `(?i)^nightly`, TrafficClass: tcBatch},
		},
		Demotion: &adminv1.Demotion{MaxPromptTokens: 8000, MaxInteractiveInFlightPerKey: 1},
	}
	set, err := tr.SetOrgTraffic(ctx, connect.NewRequest(&adminv1.SetOrgTrafficRequest{OrgId: org.Id, Traffic: want}))
	require.NoError(t, err)
	requireProto(t, want, set.Msg.Traffic)
	got, err = tr.GetOrgTraffic(ctx, connect.NewRequest(&adminv1.GetOrgTrafficRequest{OrgId: org.Id}))
	require.NoError(t, err)
	requireProto(t, want, got.Msg.Traffic)
	require.Equal(t, 1, b.auditOf(objOrgTraffic, org.Id))
	require.Equal(t, []string{"org.upserted", "org.upserted"}, b.outboxKinds("org", org.Id), "create, then the traffic change")

	// Org admins manage their own org's rules; viewers read them.
	admin := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, org.Id, "")
	_, err = b.traffic(admin).SetOrgTraffic(ctx, connect.NewRequest(&adminv1.SetOrgTrafficRequest{OrgId: org.Id, Traffic: &adminv1.OrgTraffic{DefaultClass: tcAgent}}))
	require.NoError(t, err)
	viewer := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_VIEWER, org.Id, "")
	got, err = b.traffic(viewer).GetOrgTraffic(ctx, connect.NewRequest(&adminv1.GetOrgTrafficRequest{OrgId: org.Id}))
	require.NoError(t, err)
	require.Equal(t, tcAgent, got.Msg.Traffic.DefaultClass)
	_, err = b.traffic(viewer).SetOrgTraffic(ctx, connect.NewRequest(&adminv1.SetOrgTrafficRequest{OrgId: org.Id}))
	require.Equal(t, "permission_denied", codeOf(err))

	// Setting an empty object clears everything.
	_, err = tr.SetOrgTraffic(ctx, connect.NewRequest(&adminv1.SetOrgTrafficRequest{OrgId: org.Id}))
	require.NoError(t, err)
	got, err = tr.GetOrgTraffic(ctx, connect.NewRequest(&adminv1.GetOrgTrafficRequest{OrgId: org.Id}))
	require.NoError(t, err)
	require.True(t, proto.Equal(&adminv1.OrgTraffic{}, got.Msg.Traffic))

	_, err = tr.GetOrgTraffic(ctx, connect.NewRequest(&adminv1.GetOrgTrafficRequest{OrgId: "org_missing"}))
	require.Equal(t, "not_found", codeOf(err))
}

func TestOrgTrafficValidation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("traffic-invalid")
	tr := b.traffic(b.bootstrap)
	rule := func(h, p string, c adminv1.TrafficClass) *adminv1.ClassificationRule {
		return &adminv1.ClassificationRule{Header: h, Pattern: p, TrafficClass: c}
	}
	for _, tc := range []struct {
		name  string
		t     *adminv1.OrgTraffic
		field string
	}{
		{"unknown rule class", &adminv1.OrgTraffic{Rules: []*adminv1.ClassificationRule{rule("User-Agent", "x", 9)}}, "traffic.rules[0].traffic_class"},
		{"unspecified rule class", &adminv1.OrgTraffic{Rules: []*adminv1.ClassificationRule{rule("User-Agent", "x", tcAgent), rule("User-Agent", "y", 0)}}, "traffic.rules[1].traffic_class"},
		{"bad regex", &adminv1.OrgTraffic{Rules: []*adminv1.ClassificationRule{rule("User-Agent", "(unclosed", tcAgent)}}, "traffic.rules[0].pattern: is not an RE2 regular expression"},
		{"perl lookahead RE2 refuses", &adminv1.OrgTraffic{Rules: []*adminv1.ClassificationRule{rule("User-Agent", "(?=x)", tcAgent)}}, "traffic.rules[0].pattern"},
		{"empty pattern", &adminv1.OrgTraffic{Rules: []*adminv1.ClassificationRule{rule("User-Agent", "", tcAgent)}}, "traffic.rules[0].pattern: required"},
		{"empty header", &adminv1.OrgTraffic{Rules: []*adminv1.ClassificationRule{rule("", "x", tcAgent)}}, "traffic.rules[0].header: required"},
		{"bad header name", &adminv1.OrgTraffic{Rules: []*adminv1.ClassificationRule{rule("User Agent", "x", tcAgent)}}, "traffic.rules[0].header"},
		{"credential header", &adminv1.OrgTraffic{Rules: []*adminv1.ClassificationRule{rule("authorization", "^Bearer sk-", tcAgent)}}, "traffic.rules[0].header: authorization carries credentials"},
		{"unknown default class", &adminv1.OrgTraffic{DefaultClass: 5}, "traffic.default_class"},
		{"negative prompt threshold", &adminv1.OrgTraffic{Demotion: &adminv1.Demotion{MaxPromptTokens: -1}}, "traffic.demotion.max_prompt_tokens"},
		{"negative in-flight threshold", &adminv1.OrgTraffic{Demotion: &adminv1.Demotion{MaxInteractiveInFlightPerKey: -1}}, "traffic.demotion.max_interactive_in_flight_per_key"},
	} {
		_, err := tr.SetOrgTraffic(ctx, connect.NewRequest(&adminv1.SetOrgTrafficRequest{OrgId: org.Id, Traffic: tc.t}))
		require.Equal(t, "invalid_argument", codeOf(err), tc.name)
		require.ErrorContains(t, err, tc.field, tc.name)
	}
	require.Equal(t, 0, b.auditOf(objOrgTraffic, org.Id), "refused changes are not audited")
}

func TestDeploymentTraffic(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	g := b.mkModelGroup("traffic-g")
	req := validDeployment(g, "")
	req.MaxConcurrency = 8
	d, err := b.models(b.bootstrap).CreateDeployment(ctx, connect.NewRequest(req))
	require.NoError(t, err)
	id := d.Msg.Deployment.Id
	tr := b.traffic(b.bootstrap)

	want := &adminv1.DeploymentTraffic{
		InteractiveReserve: 2, BatchMaxConcurrency: 3, PriorityScheduling: true,
		ClassPriority: &adminv1.ClassPriorities{Interactive: i32(-10), Batch: i32(0)},
		Queues:        []*adminv1.ClassQueue{{TrafficClass: tcAgent, MaxLength: 100, TimeoutMs: 30000}, {TrafficClass: tcInteractive, TimeoutMs: 5000}},
	}
	_, err = tr.SetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.SetDeploymentTrafficRequest{DeploymentId: id, Traffic: want}))
	require.NoError(t, err)
	got, err := tr.GetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.GetDeploymentTrafficRequest{DeploymentId: id}))
	require.NoError(t, err)
	requireProto(t, want, got.Msg.Traffic)
	require.Equal(t, 1, b.auditOf(objDeploymentTraffic, id))
	require.Equal(t, []string{"deployment.upserted", "deployment.upserted"}, b.outboxKinds("deployment", id))

	// max_concurrency cannot drop below what the settings need.
	_, err = b.models(b.bootstrap).UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: id, MaxConcurrency: 4}, UpdateMask: mask("max_concurrency")}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.ErrorContains(t, err, "max_concurrency: 4 conflicts with the deployment's traffic settings (traffic.batch_max_concurrency")
	_, err = b.models(b.bootstrap).UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: id, MaxConcurrency: 0}, UpdateMask: mask("max_concurrency")}))
	require.ErrorContains(t, err, "traffic.interactive_reserve: needs the deployment's max_concurrency")
	_, err = b.models(b.bootstrap).UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: id, MaxConcurrency: 5}, UpdateMask: mask("max_concurrency")}))
	require.NoError(t, err, "5 − 2 still holds a batch cap of 3")

	// Platform infrastructure: org tokens read (deployments of groups
	// granted to their org; others are not found), never write.
	org := b.mkOrg("traffic-reader")
	orgAdmin := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, org.Id, "")
	_, err = b.traffic(orgAdmin).GetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.GetDeploymentTrafficRequest{DeploymentId: id}))
	require.Equal(t, "not_found", codeOf(err), "an ungranted group's deployment")
	_, err = b.models(b.bootstrap).GrantModelGroup(ctx, connect.NewRequest(&adminv1.GrantModelGroupRequest{ModelGroup: g, OrgId: org.Id}))
	require.NoError(t, err)
	_, err = b.traffic(orgAdmin).GetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.GetDeploymentTrafficRequest{DeploymentId: id}))
	require.NoError(t, err)
	_, err = b.traffic(orgAdmin).SetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.SetDeploymentTrafficRequest{DeploymentId: id}))
	require.Equal(t, "permission_denied", codeOf(err))

	for _, tc := range []struct {
		name  string
		t     *adminv1.DeploymentTraffic
		field string
	}{
		{"reserve above max_concurrency", &adminv1.DeploymentTraffic{InteractiveReserve: 6}, "traffic.interactive_reserve: must be at most the deployment's max_concurrency 5"},
		{"negative reserve", &adminv1.DeploymentTraffic{InteractiveReserve: -1}, "traffic.interactive_reserve"},
		{"batch cap above the shared share", &adminv1.DeploymentTraffic{InteractiveReserve: 2, BatchMaxConcurrency: 4}, "traffic.batch_max_concurrency: must be at most max_concurrency − interactive_reserve = 3"},
		{"negative prefill cap", &adminv1.DeploymentTraffic{MaxPrefillTokensInFlight: -1}, "traffic.max_prefill_tokens_in_flight"},
		{"prefill cap too large", &adminv1.DeploymentTraffic{MaxPrefillTokensInFlight: 2_000_000_000}, "traffic.max_prefill_tokens_in_flight: must be at most"},
		{"class priority without priority scheduling", &adminv1.DeploymentTraffic{ClassPriority: &adminv1.ClassPriorities{Agent: i32(1)}}, "traffic.class_priority: only with priority_scheduling"},
		{"priority out of range", &adminv1.DeploymentTraffic{PriorityScheduling: true, ClassPriority: &adminv1.ClassPriorities{Agent: i32(2_000_000)}}, "traffic.class_priority.agent"},
		{"queue class unknown", &adminv1.DeploymentTraffic{Queues: []*adminv1.ClassQueue{{TrafficClass: 0, MaxLength: 1}}}, "traffic.queues[0].traffic_class"},
		{"queue class twice", &adminv1.DeploymentTraffic{Queues: []*adminv1.ClassQueue{{TrafficClass: tcBatch, MaxLength: 1}, {TrafficClass: tcBatch, TimeoutMs: 1}}}, "traffic.queues[1].traffic_class: duplicate"},
		{"queue too long", &adminv1.DeploymentTraffic{Queues: []*adminv1.ClassQueue{{TrafficClass: tcBatch, MaxLength: 1_000_000}}}, "traffic.queues[0].max_length"},
		{"queue timeout too long", &adminv1.DeploymentTraffic{Queues: []*adminv1.ClassQueue{{TrafficClass: tcBatch, TimeoutMs: 3_600_000}}}, "traffic.queues[0].timeout_ms"},
		{"empty override", &adminv1.DeploymentTraffic{Queues: []*adminv1.ClassQueue{{TrafficClass: tcBatch}}}, "traffic.queues[0]: overrides nothing"},
	} {
		_, err := tr.SetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.SetDeploymentTrafficRequest{DeploymentId: id, Traffic: tc.t}))
		require.Equal(t, "invalid_argument", codeOf(err), tc.name)
		require.ErrorContains(t, err, tc.field, tc.name)
	}

	// A reserve needs a capacity to reserve from.
	nocap := b.mkDeployment(g, "")
	_, err = tr.SetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.SetDeploymentTrafficRequest{DeploymentId: nocap.Id,
		Traffic: &adminv1.DeploymentTraffic{InteractiveReserve: 1}}))
	require.ErrorContains(t, err, "traffic.interactive_reserve: needs the deployment's max_concurrency")
	_, err = tr.SetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.SetDeploymentTrafficRequest{DeploymentId: nocap.Id,
		Traffic: &adminv1.DeploymentTraffic{MaxPrefillTokensInFlight: 16384}}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.ErrorContains(t, err, "traffic.max_prefill_tokens_in_flight: needs the deployment's max_concurrency")
}

// TestDeploymentPrefillCap: a prefill cap is accepted, stored and read
// back on a deployment with max_concurrency, and its max_concurrency
// cannot then be removed.
func TestDeploymentPrefillCap(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	g := b.mkModelGroup("traffic-prefill")
	req := validDeployment(g, "")
	req.MaxConcurrency = 8
	d, err := b.models(b.bootstrap).CreateDeployment(ctx, connect.NewRequest(req))
	require.NoError(t, err)
	id := d.Msg.Deployment.Id
	tr := b.traffic(b.bootstrap)
	want := &adminv1.DeploymentTraffic{InteractiveReserve: 2, MaxPrefillTokensInFlight: 16384}
	_, err = tr.SetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.SetDeploymentTrafficRequest{DeploymentId: id, Traffic: want}))
	require.NoError(t, err)
	got, err := tr.GetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.GetDeploymentTrafficRequest{DeploymentId: id}))
	require.NoError(t, err)
	requireProto(t, want, got.Msg.Traffic)
	require.Equal(t, 1, b.auditOf(objDeploymentTraffic, id))
	_, err = tr.SetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.SetDeploymentTrafficRequest{DeploymentId: id,
		Traffic: &adminv1.DeploymentTraffic{MaxPrefillTokensInFlight: -5}}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.ErrorContains(t, err, "traffic.max_prefill_tokens_in_flight: must not be negative")
	_, err = b.models(b.bootstrap).UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: id, MaxConcurrency: 0}, UpdateMask: mask("max_concurrency")}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.ErrorContains(t, err, "traffic.max_prefill_tokens_in_flight: needs the deployment's max_concurrency")
}

func TestModelGroupTraffic(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	g := b.mkModelGroup("traffic-queues")
	tr := b.traffic(b.bootstrap)
	want := &adminv1.ModelGroupTraffic{Queues: []*adminv1.ClassQueue{{TrafficClass: tcBatch, MaxLength: 1000, TimeoutMs: 120000}}}
	_, err := tr.SetModelGroupTraffic(ctx, connect.NewRequest(&adminv1.SetModelGroupTrafficRequest{ModelGroup: g, Traffic: want}))
	require.NoError(t, err)
	got, err := tr.GetModelGroupTraffic(ctx, connect.NewRequest(&adminv1.GetModelGroupTrafficRequest{ModelGroup: g}))
	require.NoError(t, err)
	requireProto(t, want, got.Msg.Traffic)
	require.Equal(t, 1, b.auditOf(objModelGroupTraffic, g))
	require.Equal(t, []string{"model_group.upserted", "model_group.upserted"}, b.outboxKinds("model_group", g))
	_, err = tr.SetModelGroupTraffic(ctx, connect.NewRequest(&adminv1.SetModelGroupTrafficRequest{ModelGroup: g,
		Traffic: &adminv1.ModelGroupTraffic{Queues: []*adminv1.ClassQueue{{TrafficClass: 7, MaxLength: 1}}}}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.ErrorContains(t, err, "traffic.queues[0].traffic_class")
	_, err = tr.SetModelGroupTraffic(ctx, connect.NewRequest(&adminv1.SetModelGroupTrafficRequest{ModelGroup: "no-such-group"}))
	require.Equal(t, "not_found", codeOf(err))
}

// TestModelGroupPrefillIsolation: prefill_isolation must stay below the
// group's number of deployments (InvalidArgument naming the field
// otherwise), is stored, audited and published like the group's other
// traffic settings.
func TestModelGroupPrefillIsolation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	g := b.mkModelGroup("traffic-isolation")
	tr := b.traffic(b.bootstrap)
	set := func(k int64) error {
		_, err := tr.SetModelGroupTraffic(ctx, connect.NewRequest(&adminv1.SetModelGroupTrafficRequest{ModelGroup: g,
			Traffic: &adminv1.ModelGroupTraffic{PrefillIsolation: k}}))
		return err
	}
	err := set(1)
	require.Equal(t, "invalid_argument", codeOf(err), "a group without deployments")
	require.ErrorContains(t, err, "traffic.prefill_isolation: must be below the group's number of deployments (0)")
	b.mkDeployment(g, "")
	err = set(1)
	require.Equal(t, "invalid_argument", codeOf(err), "one deployment: none would be left for agents")
	require.ErrorContains(t, err, "(1)")
	err = set(-1)
	require.Equal(t, "invalid_argument", codeOf(err))
	require.ErrorContains(t, err, "traffic.prefill_isolation: must be 0 (off)")
	require.Zero(t, b.auditOf(objModelGroupTraffic, g), "refused settings are not written")

	b.mkDeployment(g, "")
	require.NoError(t, set(1))
	got, err := tr.GetModelGroupTraffic(ctx, connect.NewRequest(&adminv1.GetModelGroupTrafficRequest{ModelGroup: g}))
	require.NoError(t, err)
	requireProto(t, &adminv1.ModelGroupTraffic{PrefillIsolation: 1}, got.Msg.Traffic)
	require.Equal(t, 1, b.auditOf(objModelGroupTraffic, g))
	require.ErrorContains(t, set(2), "(2)")
	require.NoError(t, set(0), "off")
}
