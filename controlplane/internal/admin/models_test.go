package admin

import (
	"context"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/internal/keyring"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// models returns a ModelService client for tok on the bundle's server.
func (b *bundle) models(tok string) adminv1connect.ModelServiceClient {
	return adminv1connect.NewModelServiceClient(http.DefaultClient, b.url, connect.WithInterceptors(bearer(tok)))
}

// mkModelGroup creates a model group with the bootstrap token.
func (b *bundle) mkModelGroup(name string) string {
	b.t.Helper()
	_, err := b.models(b.bootstrap).CreateModelGroup(context.Background(), connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: name}))
	require.NoError(b.t, err)
	return name
}

// mkDeployment creates a priced deployment of group with the bootstrap
// token; cred "" stores none.
func (b *bundle) mkDeployment(group, cred string) *adminv1.Deployment {
	b.t.Helper()
	r, err := b.models(b.bootstrap).CreateDeployment(context.Background(), connect.NewRequest(validDeployment(group, cred)))
	require.NoError(b.t, err)
	return r.Msg.Deployment
}

func validDeployment(group, cred string) *adminv1.CreateDeploymentRequest {
	return &adminv1.CreateDeploymentRequest{
		ModelGroup: group, ApiBase: "http://vllm-a:8000/v1", UpstreamModel: "Qwen/Qwen3-30B-A3B", Credential: cred,
		Prices: &adminv1.Prices{InputPerToken: 2e-7, OutputPerToken: 8e-7},
	}
}

func mask(paths ...string) *fieldmaskpb.FieldMask { return &fieldmaskpb.FieldMask{Paths: paths} }

func TestModelGroupAndDeploymentLifecycle(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	m := b.models(b.bootstrap)
	auditBefore := b.auditCount()

	g, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "qwen-30b", Description: "Qwen3 30B"}))
	require.NoError(t, err)
	require.Equal(t, "qwen-30b", g.Msg.ModelGroup.Name)
	_, err = m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "qwen-30b"}))
	require.Equal(t, "already_exists", codeOf(err))
	b.mkModelGroup("a-first")
	page1, err := m.ListModelGroups(ctx, connect.NewRequest(&adminv1.ListModelGroupsRequest{PageSize: 1}))
	require.NoError(t, err)
	require.Equal(t, "a-first", page1.Msg.ModelGroups[0].Name)
	page2, err := m.ListModelGroups(ctx, connect.NewRequest(&adminv1.ListModelGroupsRequest{PageSize: 1, PageToken: page1.Msg.NextPageToken}))
	require.NoError(t, err)
	require.Equal(t, "qwen-30b", page2.Msg.ModelGroups[0].Name)

	ug, err := m.UpdateModelGroup(ctx, connect.NewRequest(&adminv1.UpdateModelGroupRequest{
		ModelGroup: &adminv1.ModelGroup{Name: "qwen-30b", Description: "Qwen3 30B A3B"}, UpdateMask: mask("description")}))
	require.NoError(t, err)
	require.Equal(t, "Qwen3 30B A3B", ug.Msg.ModelGroup.Description)

	req := validDeployment("qwen-30b", "sk-upstream-1")
	req.Weight, req.MaxConcurrency, req.Tags = 0, 64, []string{"interactive", "gpu:h100"}
	req.Capabilities = &adminv1.Capabilities{Tools: true, MaxInputTokens: 32768}
	d, err := m.CreateDeployment(ctx, connect.NewRequest(req))
	require.NoError(t, err)
	dep := d.Msg.Deployment
	require.True(t, strings.HasPrefix(dep.Id, "dep_"), dep.Id)
	require.True(t, dep.HasCredential)
	require.EqualValues(t, 1, dep.Weight, "weight 0 on create means 1")
	require.Equal(t, []string{"interactive", "gpu:h100"}, dep.Tags)

	got, err := m.GetDeployment(ctx, connect.NewRequest(&adminv1.GetDeploymentRequest{Id: dep.Id}))
	require.NoError(t, err)
	require.Equal(t, int64(32768), got.Msg.Deployment.Capabilities.MaxInputTokens)
	code, body := b.callJSON(b.bootstrap, "/sluice.admin.v1.ModelService/GetDeployment", `{"id":"`+dep.Id+`"}`)
	require.Equal(t, "ok", code)
	require.Contains(t, string(body), `"hasCredential":true`)
	require.NotContains(t, string(body), "sk-upstream-1", "the credential is never returned")

	up, err := m.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: dep.Id, Weight: 7, Tags: []string{"agents"},
			Prices: &adminv1.Prices{OutputPerToken: 9e-7}, Capabilities: &adminv1.Capabilities{Vision: true}},
		UpdateMask: mask("weight", "tags", "prices.output_per_token", "capabilities.vision")}))
	require.NoError(t, err)
	ud := up.Msg.Deployment
	require.EqualValues(t, 7, ud.Weight)
	require.Equal(t, []string{"agents"}, ud.Tags)
	require.Equal(t, 2e-7, ud.Prices.InputPerToken, "fields outside the mask keep their values")
	require.Equal(t, 9e-7, ud.Prices.OutputPerToken)
	require.True(t, ud.Capabilities.Tools && ud.Capabilities.Vision)
	require.True(t, ud.HasCredential)

	// The credential changes only through "credential" in the mask.
	_, err = m.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: dep.Id}, Credential: "sk-upstream-2", UpdateMask: mask("weight")}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.ErrorContains(t, err, "credential")
	before := b.ciphertext(dep.Id)
	_, err = m.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: dep.Id}, Credential: "sk-upstream-2", UpdateMask: mask("credential")}))
	require.NoError(t, err)
	require.NotEqual(t, before, b.ciphertext(dep.Id))
	require.Equal(t, "sk-upstream-2", b.open(b.ciphertext(dep.Id)))
	rm, err := m.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: dep.Id}, UpdateMask: mask("credential")}))
	require.NoError(t, err)
	require.False(t, rm.Msg.Deployment.HasCredential)
	require.Nil(t, b.ciphertext(dep.Id))

	list, err := m.ListDeployments(ctx, connect.NewRequest(&adminv1.ListDeploymentsRequest{ModelGroup: "qwen-30b"}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Deployments, 1)
	list, err = m.ListDeployments(ctx, connect.NewRequest(&adminv1.ListDeploymentsRequest{ModelGroup: "a-first"}))
	require.NoError(t, err)
	require.Empty(t, list.Msg.Deployments)
	_, err = m.ListDeployments(ctx, connect.NewRequest(&adminv1.ListDeploymentsRequest{ModelGroup: "no-such-group"}))
	require.Equal(t, "not_found", codeOf(err))

	_, err = m.DeleteModelGroup(ctx, connect.NewRequest(&adminv1.DeleteModelGroupRequest{Name: "qwen-30b"}))
	require.Equal(t, "failed_precondition", codeOf(err))
	require.ErrorContains(t, err, "still has 1 deployments")
	_, err = m.DeleteDeployment(ctx, connect.NewRequest(&adminv1.DeleteDeploymentRequest{Id: dep.Id}))
	require.NoError(t, err)
	_, err = m.GetDeployment(ctx, connect.NewRequest(&adminv1.GetDeploymentRequest{Id: dep.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = m.DeleteModelGroup(ctx, connect.NewRequest(&adminv1.DeleteModelGroupRequest{Name: "qwen-30b"}))
	require.NoError(t, err)
	_, err = m.GetModelGroup(ctx, connect.NewRequest(&adminv1.GetModelGroupRequest{Name: "qwen-30b"}))
	require.Equal(t, "not_found", codeOf(err))

	// One audit row per mutation, platform-wide (org ""), and an outbox
	// event for every change.
	type row struct{ Action, ObjectType, ObjectID, OrgID string }
	rows, err := b.pool.Query(ctx, `SELECT action, object_type, object_id, org_id FROM audit_log WHERE seq > $1 ORDER BY seq`, auditBefore)
	require.NoError(t, err)
	var audits []row
	for rows.Next() {
		var r row
		require.NoError(t, rows.Scan(&r.Action, &r.ObjectType, &r.ObjectID, &r.OrgID))
		audits = append(audits, r)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []row{
		{"created", "model_group", "qwen-30b", ""},
		{"created", "model_group", "a-first", ""},
		{"updated", "model_group", "qwen-30b", ""},
		{"created", "deployment", dep.Id, ""},
		{"updated", "deployment", dep.Id, ""},
		{"updated", "deployment", dep.Id, ""},
		{"updated", "deployment", dep.Id, ""},
		{"deleted", "deployment", dep.Id, ""},
		{"deleted", "model_group", "qwen-30b", ""},
	}, audits)
	var kinds []string
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT array_agg(kind || ' ' || object_type || ' ' || object_id || ' ' || org_id ORDER BY seq)
		FROM outbox WHERE object_type IN ('model_group', 'deployment')`).Scan(&kinds))
	require.Equal(t, []string{
		"model_group.upserted model_group qwen-30b ",
		"model_group.upserted model_group a-first ",
		"model_group.upserted model_group qwen-30b ",
		"deployment.upserted deployment " + dep.Id + " ",
		"deployment.upserted deployment " + dep.Id + " ",
		"deployment.upserted deployment " + dep.Id + " ",
		"deployment.upserted deployment " + dep.Id + " ",
		"deployment.deleted deployment " + dep.Id + " ",
		"model_group.deleted model_group qwen-30b ",
	}, kinds)
	resp, err := b.root().Audit.VerifyAuditChain(ctx, connect.NewRequest(&adminv1.VerifyAuditChainRequest{}))
	require.NoError(t, err)
	require.True(t, resp.Msg.Ok, resp.Msg.Problem)
}

// ciphertext reads a deployment's stored credential.
func (b *bundle) ciphertext(id string) []byte {
	b.t.Helper()
	var ct []byte
	require.NoError(b.t, b.pool.QueryRow(context.Background(), `SELECT credential_ciphertext FROM deployments WHERE id = $1`, id).Scan(&ct))
	return ct
}

// open decrypts ct with the test key ring.
func (b *bundle) open(ct []byte) string {
	b.t.Helper()
	ring, err := keyring.Parse(testKEK)
	require.NoError(b.t, err)
	pt, err := ring.Open(ct)
	require.NoError(b.t, err)
	return string(pt)
}

func TestDeploymentValidationNamesEachField(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	m := b.models(b.bootstrap)
	b.mkModelGroup("g")
	const secret = "sk-never-echo-me"
	manyTags := make([]string, 33)
	for i := range manyTags {
		manyTags[i] = "t" + strings.Repeat("x", i)
	}
	for _, tc := range []struct {
		name  string
		edit  func(r *adminv1.CreateDeploymentRequest)
		field string
	}{
		{"group name pattern", func(r *adminv1.CreateDeploymentRequest) { r.ModelGroup = "bad name" }, "model_group:"},
		{"api_base missing", func(r *adminv1.CreateDeploymentRequest) { r.ApiBase = "" }, "api_base:"},
		{"api_base scheme", func(r *adminv1.CreateDeploymentRequest) { r.ApiBase = "ftp://vllm/v1" }, "api_base:"},
		{"api_base no host", func(r *adminv1.CreateDeploymentRequest) { r.ApiBase = "http:///v1" }, "api_base:"},
		{"api_base credentials", func(r *adminv1.CreateDeploymentRequest) { r.ApiBase = "https://user:pw@vllm/v1" }, "must not contain credentials"},
		{"api_base query", func(r *adminv1.CreateDeploymentRequest) { r.ApiBase = "https://vllm/v1?key=x" }, "api_base:"},
		{"upstream_model empty", func(r *adminv1.CreateDeploymentRequest) { r.UpstreamModel = "" }, "upstream_model:"},
		{"upstream_model long", func(r *adminv1.CreateDeploymentRequest) { r.UpstreamModel = strings.Repeat("m", 201) }, "upstream_model:"},
		{"weight high", func(r *adminv1.CreateDeploymentRequest) { r.Weight = 1001 }, "weight:"},
		{"weight negative", func(r *adminv1.CreateDeploymentRequest) { r.Weight = -1 }, "weight:"},
		{"max_concurrency", func(r *adminv1.CreateDeploymentRequest) { r.MaxConcurrency = -1 }, "max_concurrency:"},
		{"max_input_tokens", func(r *adminv1.CreateDeploymentRequest) {
			r.Capabilities = &adminv1.Capabilities{MaxInputTokens: -1}
		}, "capabilities.max_input_tokens:"},
		{"max_output_tokens", func(r *adminv1.CreateDeploymentRequest) {
			r.Capabilities = &adminv1.Capabilities{MaxOutputTokens: -5}
		}, "capabilities.max_output_tokens:"},
		{"protocol unknown", func(r *adminv1.CreateDeploymentRequest) {
			r.Capabilities = &adminv1.Capabilities{Protocols: []string{"anthropic_messages", "grpc"}}
		}, "capabilities.protocols[1]: unknown protocol"},
		{"protocol duplicate", func(r *adminv1.CreateDeploymentRequest) {
			r.Capabilities = &adminv1.Capabilities{Protocols: []string{"openai_responses", "openai_responses"}}
		}, "capabilities.protocols[1]: duplicate"},
		{"tag chars", func(r *adminv1.CreateDeploymentRequest) { r.Tags = []string{"ok", "not ok"} }, "tags[1]:"},
		{"tag duplicate", func(r *adminv1.CreateDeploymentRequest) { r.Tags = []string{"a", "a"} }, "tags[1]: duplicate"},
		{"tag long", func(r *adminv1.CreateDeploymentRequest) { r.Tags = []string{strings.Repeat("t", 65)} }, "tags[0]:"},
		{"too many tags", func(r *adminv1.CreateDeploymentRequest) { r.Tags = manyTags }, "tags: at most 32"},
		{"input price negative", func(r *adminv1.CreateDeploymentRequest) { r.Prices.InputPerToken = -1e-6 }, "prices.input_per_token:"},
		{"output price NaN", func(r *adminv1.CreateDeploymentRequest) { r.Prices.OutputPerToken = math.NaN() }, "prices.output_per_token: must be a finite"},
		{"cached price Inf", func(r *adminv1.CreateDeploymentRequest) { r.Prices.CachedInputPerToken = math.Inf(1) }, "prices.cached_input_per_token: must be a finite"},
		{"price per million", func(r *adminv1.CreateDeploymentRequest) { r.Prices.InputPerToken = 15 }, "prices.input_per_token: must be at most"},
		{"no prices", func(r *adminv1.CreateDeploymentRequest) { r.Prices = nil }, "prices: required"},
		{"zero prices", func(r *adminv1.CreateDeploymentRequest) { r.Prices = &adminv1.Prices{} }, "prices: required"},
		{"only a cached price", func(r *adminv1.CreateDeploymentRequest) {
			r.Prices = &adminv1.Prices{CachedInputPerToken: 1e-7}
		}, "prices: required"},
		{"free with prices", func(r *adminv1.CreateDeploymentRequest) { r.Free = true }, "prices: must be zero or unset on a free deployment"},
		{"credential too long", func(r *adminv1.CreateDeploymentRequest) { r.Credential = secret + strings.Repeat("k", 4096) }, "credential: must be at most 4096 bytes"},
		{"credential newline", func(r *adminv1.CreateDeploymentRequest) { r.Credential = secret + "\nX-Injected: 1" }, "credential:"},
	} {
		req := validDeployment("g", "")
		tc.edit(req)
		_, err := m.CreateDeployment(ctx, connect.NewRequest(req))
		require.Equal(t, "invalid_argument", codeOf(err), tc.name)
		require.ErrorContains(t, err, tc.field, tc.name)
		require.NotContains(t, err.Error(), secret, "%s: the credential is never echoed", tc.name)
	}
	_, err := m.CreateDeployment(ctx, connect.NewRequest(validDeployment("no-such-group", "")))
	require.Equal(t, "not_found", codeOf(err))
	require.ErrorContains(t, err, "model group no-such-group not found")
	for _, name := range []string{"", "has space", strings.Repeat("n", 101), "emoji-😀"} {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: name}))
		require.Equal(t, "invalid_argument", codeOf(err), name)
		require.ErrorContains(t, err, "name:", name)
	}

	// Declared free: no prices needed, and prices cannot come back
	// without clearing free (nor vanish without declaring it).
	free := validDeployment("g", "")
	free.Prices, free.Free = nil, true
	fd, err := m.CreateDeployment(ctx, connect.NewRequest(free))
	require.NoError(t, err)
	require.True(t, fd.Msg.Deployment.Free)
	_, err = m.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: fd.Msg.Deployment.Id, Prices: &adminv1.Prices{InputPerToken: 1e-6}}, UpdateMask: mask("prices")}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.ErrorContains(t, err, "prices: must be zero or unset on a free deployment")
	_, err = m.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: fd.Msg.Deployment.Id, Prices: &adminv1.Prices{InputPerToken: 1e-6}}, UpdateMask: mask("prices", "free")}))
	require.NoError(t, err, "clearing free while setting prices")
	priced := b.mkDeployment("g", "")
	_, err = m.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: priced.Id}, UpdateMask: mask("prices")}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.ErrorContains(t, err, "prices: required")
	_, err = m.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: priced.Id, ModelGroup: "g"}, UpdateMask: mask("model_group")}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.ErrorContains(t, err, "update_mask")
	_, err = m.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: priced.Id, ApiBase: "http://u:p@x/v1"}, UpdateMask: mask("api_base")}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.ErrorContains(t, err, "api_base:")
}

func TestDeploymentCredentialIsEncryptedAtRest(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	const secret = "sk-upstream-plaintext-0123456789"
	b.mkModelGroup("g")
	dep := b.mkDeployment("g", secret)

	ct := b.ciphertext(dep.Id)
	require.True(t, strings.HasPrefix(string(ct), "v1:"), "ciphertext names its key version: %q", ct[:3])
	require.NotContains(t, string(ct), secret)
	require.Equal(t, secret, b.open(ct))
	// Nowhere in the database or the logs is the plaintext: not in any
	// column of the deployment, the audit trail or the outbox.
	var leaks int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM deployments d WHERE d::text LIKE '%' || $1 || '%') +
		(SELECT count(*) FROM audit_log a WHERE a::text LIKE '%' || $1 || '%') +
		(SELECT count(*) FROM outbox o WHERE o::text LIKE '%' || $1 || '%')`, secret).Scan(&leaks))
	require.Zero(t, leaks)
	require.NotContains(t, b.logs.String(), secret)
	var after string
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT after_json FROM audit_log WHERE object_type = 'deployment' AND object_id = $1`, dep.Id).Scan(&after))
	require.Contains(t, after, `"has_credential":true`)
	require.NotContains(t, after, "credential_ciphertext")
}

// TestKeyRingRotation: a credential sealed under key 1 still opens after
// the ring becomes "2:..,1:..", and new credentials use key 2.
func TestKeyRingRotation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.mkModelGroup("g")
	old := b.mkDeployment("g", "sk-old")
	require.True(t, strings.HasPrefix(string(b.ciphertext(old.Id)), "v1:"))

	const key2 = "2:cm90YXRlZC1rZWstdHdvLTAxMjM0NTY3ODlhYmNkZWY="
	rotated, err := keyring.Parse(key2 + "," + testKEK)
	require.NoError(t, err)
	srv := httptest.NewServer(NewHandler(Options{Store: b.store, Peppers: b.peppers, BootstrapToken: b.bootstrap,
		KeyRing: rotated, Logger: slog.New(slog.DiscardHandler)}))
	t.Cleanup(srv.Close)
	m2 := adminv1connect.NewModelServiceClient(http.DefaultClient, srv.URL, connect.WithInterceptors(bearer(b.bootstrap)))
	r, err := m2.CreateDeployment(ctx, connect.NewRequest(validDeployment("g", "sk-new")))
	require.NoError(t, err)
	newCT := b.ciphertext(r.Msg.Deployment.Id)
	require.True(t, strings.HasPrefix(string(newCT), "v2:"), "new credentials use the highest version")

	pt, err := rotated.Open(b.ciphertext(old.Id))
	require.NoError(t, err)
	require.Equal(t, "sk-old", string(pt))
	pt, err = rotated.Open(newCT)
	require.NoError(t, err)
	require.Equal(t, "sk-new", string(pt))
	v1only, err := keyring.Parse(testKEK)
	require.NoError(t, err)
	_, err = v1only.Open(newCT)
	require.ErrorIs(t, err, keyring.ErrUnknownKey)

	// Re-sealing under the new key: setting the credential again.
	_, err = m2.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: old.Id}, Credential: "sk-old", UpdateMask: mask("credential")}))
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(string(b.ciphertext(old.Id)), "v2:"))

	// A server without a key ring refuses to store credentials, clearly.
	bare := httptest.NewServer(NewHandler(Options{Store: b.store, Peppers: b.peppers, BootstrapToken: b.bootstrap}))
	t.Cleanup(bare.Close)
	m3 := adminv1connect.NewModelServiceClient(http.DefaultClient, bare.URL, connect.WithInterceptors(bearer(b.bootstrap)))
	_, err = m3.CreateDeployment(ctx, connect.NewRequest(validDeployment("g", "sk-x")))
	require.Equal(t, "failed_precondition", codeOf(err))
	require.ErrorContains(t, err, "SLUICE_KEK")
}

func TestModelsAuthorisation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("acme")
	team, err := b.root().Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: org.Id, Name: "t"}))
	require.NoError(t, err)
	// Platform-wide, so every org's tokens may read it (grants:
	// TestModelGroupGrants).
	_, err = b.models(b.bootstrap).CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "g", PlatformWide: true}))
	require.NoError(t, err)
	dep := b.mkDeployment("g", "sk-secret")

	readers := map[string]string{
		"org admin":       b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, org.Id, ""),
		"team viewer":     b.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_VIEWER, org.Id, team.Msg.Team.Id),
		"platform viewer": b.mkToken(adminv1.Scope_SCOPE_PLATFORM, adminv1.Role_ROLE_VIEWER, "", ""),
	}
	before := b.auditCount()
	for who, tok := range readers {
		m := b.models(tok)
		g, err := m.GetModelGroup(ctx, connect.NewRequest(&adminv1.GetModelGroupRequest{Name: "g"}))
		require.NoError(t, err, who)
		require.Equal(t, "g", g.Msg.ModelGroup.Name)
		l, err := m.ListModelGroups(ctx, connect.NewRequest(&adminv1.ListModelGroupsRequest{}))
		require.NoError(t, err, who)
		require.Len(t, l.Msg.ModelGroups, 1)
		d, err := m.GetDeployment(ctx, connect.NewRequest(&adminv1.GetDeploymentRequest{Id: dep.Id}))
		require.NoError(t, err, who)
		require.True(t, d.Msg.Deployment.HasCredential)
		ld, err := m.ListDeployments(ctx, connect.NewRequest(&adminv1.ListDeploymentsRequest{}))
		require.NoError(t, err, who)
		require.Len(t, ld.Msg.Deployments, 1)

		_, err = m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "x"}))
		require.Equal(t, "permission_denied", codeOf(err), who)
		_, err = m.CreateDeployment(ctx, connect.NewRequest(validDeployment("g", "")))
		require.Equal(t, "permission_denied", codeOf(err), who)
		_, err = m.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
			Deployment: &adminv1.Deployment{Id: dep.Id, Weight: 3}, UpdateMask: mask("weight")}))
		require.Equal(t, "permission_denied", codeOf(err), who)
		_, err = m.DeleteDeployment(ctx, connect.NewRequest(&adminv1.DeleteDeploymentRequest{Id: dep.Id}))
		require.Equal(t, "permission_denied", codeOf(err), who)
		_, err = m.DeleteModelGroup(ctx, connect.NewRequest(&adminv1.DeleteModelGroupRequest{Name: "g"}))
		require.Equal(t, "permission_denied", codeOf(err), who)
	}
	require.Equal(t, before, b.auditCount(), "refused calls write no audit rows")

	// A platform editor may change them.
	ed := b.models(b.mkToken(adminv1.Scope_SCOPE_PLATFORM, adminv1.Role_ROLE_EDITOR, "", ""))
	_, err = ed.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "by-editor"}))
	require.NoError(t, err)
	_, err = ed.DeleteDeployment(ctx, connect.NewRequest(&adminv1.DeleteDeploymentRequest{Id: dep.Id}))
	require.NoError(t, err)
	var actor, tokenID string
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT actor, token_id FROM audit_log WHERE object_type = 'deployment' AND action = 'deleted'`).Scan(&actor, &tokenID))
	require.True(t, strings.HasPrefix(actor, "tok_"), actor)
	require.Equal(t, actor, tokenID)
}
