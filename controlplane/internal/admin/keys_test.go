package admin

import (
	"context"
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/internal/ids"
	"github.com/sluicegw/sluice/internal/token"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// keyEnv is a test bundle with one org ("acme") and helpers for keys.
// Teams and users are made with plain SQL so that these tests depend on
// the key service only.
type keyEnv struct {
	*bundle
	ctx context.Context
	c   clients
	org string
}

func newKeyEnv(t *testing.T) *keyEnv {
	t.Helper()
	b := setup(t)
	return &keyEnv{bundle: b, ctx: context.Background(), c: b.root(), org: b.mkOrg("acme").Id}
}

func (e *keyEnv) exec(sql string, args ...any) {
	e.t.Helper()
	_, err := e.pool.Exec(e.ctx, sql, args...)
	require.NoError(e.t, err, sql)
}

// member makes user a member of team (of org).
func (e *keyEnv) member(org, team, user string) {
	e.t.Helper()
	e.exec(`INSERT INTO team_members (team_id, user_id, org_id, created_at, updated_at) VALUES ($1, $2, $3, $4, $4)`, team, user, org, e.clock.Now())
}

// team inserts a team of org and returns its id.
func (e *keyEnv) team(org, name string) string {
	e.t.Helper()
	id := ids.New(ids.Team)
	e.exec(`INSERT INTO teams (id, org_id, name, created_at, updated_at) VALUES ($1, $2, $3, $4, $4)`, id, org, name, e.clock.Now())
	return id
}

// user inserts a user of org and returns its id.
func (e *keyEnv) user(org, email string) string {
	e.t.Helper()
	id := ids.New(ids.User)
	e.exec(`INSERT INTO users (id, org_id, email, created_at, updated_at) VALUES ($1, $2, $3, $4, $4)`, id, org, email, e.clock.Now())
	return id
}

// create creates a key with the bootstrap token; org defaults to e.org.
func (e *keyEnv) create(req *adminv1.CreateKeyRequest) (*adminv1.Key, string) {
	e.t.Helper()
	if req.OrgId == "" {
		req.OrgId = e.org
	}
	resp, err := e.c.Key.CreateKey(e.ctx, connect.NewRequest(req))
	require.NoError(e.t, err)
	return resp.Msg.Key, resp.Msg.Token
}

func (e *keyEnv) get(id string) *adminv1.Key {
	e.t.Helper()
	resp, err := e.c.Key.GetKey(e.ctx, connect.NewRequest(&adminv1.GetKeyRequest{Id: id}))
	require.NoError(e.t, err)
	return resp.Msg.Key
}

// outbox returns the kinds of the outbox rows of object id, in order.
func (e *keyEnv) outbox(id string) []string {
	e.t.Helper()
	rows, err := e.pool.Query(e.ctx, `SELECT kind FROM outbox WHERE object_id = $1 ORDER BY seq`, id)
	require.NoError(e.t, err)
	var out []string
	for rows.Next() {
		var k string
		require.NoError(e.t, rows.Scan(&k))
		out = append(out, k)
	}
	require.NoError(e.t, rows.Err())
	return out
}

// lastPayload returns the payload of the last outbox row of object id.
func (e *keyEnv) lastPayload(id string) string {
	e.t.Helper()
	var p string
	require.NoError(e.t, e.pool.QueryRow(e.ctx, `SELECT payload::text FROM outbox WHERE object_id = $1 ORDER BY seq DESC LIMIT 1`, id).Scan(&p))
	return p
}

// auditActions returns the audit actions of object id, in order.
func (e *keyEnv) auditActions(id string) []string {
	e.t.Helper()
	rows, err := e.pool.Query(e.ctx, `SELECT action FROM audit_log WHERE object_id = $1 ORDER BY seq`, id)
	require.NoError(e.t, err)
	var out []string
	for rows.Next() {
		var a string
		require.NoError(e.t, rows.Scan(&a))
		out = append(out, a)
	}
	require.NoError(e.t, rows.Err())
	return out
}

// authState looks tok up in the control plane's key export
// (store.KeyAuthRecords) at the bundle's clock, with the semantics the
// data plane applies to it (catalog.Authenticate): "ok <key id>", "unknown",
// "expired" or "blocked <scope>". (dataplane/internal/authn itself cannot
// be imported from here: Go's internal rule keeps the planes apart.)
func (e *keyEnv) authState(tok string) string {
	e.t.Helper()
	require.NoError(e.t, token.Check(token.KeyPrefix, tok))
	recs, err := e.store.KeyAuthRecords(e.ctx)
	require.NoError(e.t, err)
	now := e.clock.Now()
	for _, r := range recs {
		matches := func(ver int, hash []byte) bool {
			h, err := e.peppers.Hash(ver, tok)
			return err == nil && token.Equal(h, hash)
		}
		found := matches(r.PepperVersion, r.Hash)
		for _, o := range r.OldHashes {
			if matches(o.PepperVersion, o.Hash) {
				if !now.Before(o.ValidUntil) {
					return "unknown"
				}
				found = true
			}
		}
		if !found {
			continue
		}
		if r.ExpiresAt != nil && !now.Before(*r.ExpiresAt) {
			return "expired"
		}
		if r.BlockedScope != "" {
			return "blocked " + r.BlockedScope
		}
		return "ok " + r.KeyID
	}
	return "unknown"
}

func keyMask(paths ...string) *fieldmaskpb.FieldMask { return &fieldmaskpb.FieldMask{Paths: paths} }

func TestKeyLifecycle(t *testing.T) {
	t.Parallel()
	e := newKeyEnv(t)
	team := e.team(e.org, "ml")
	user := e.user(e.org, "ada@example.com")
	e.member(e.org, team, user)

	auditBefore := e.auditCount()
	k, tok := e.create(&adminv1.CreateKeyRequest{
		TeamId: team, UserId: user, Project: "search", Alias: "ci-bot",
		Tags: []string{"env:prod", "team/ml"}, TrafficClass: adminv1.TrafficClass_TRAFFIC_CLASS_AGENT,
		ModelGroupAliases: map[string]string{"qwen-30b": "qwen-30b-agents"},
		EnforcedParams:    []string{"user", "metadata.generation_name"},
		AllowedRoutes:     []string{"/v1/chat/completions", "/v1/models"},
		Limits:            &adminv1.Limits{RpmLimit: proto.Int64(60), ModelTpmLimit: map[string]int64{"qwen-30b": 1000}},
		Metadata:          map[string]string{"owner": "ada"},
	})
	require.Equal(t, auditBefore+1, e.auditCount())
	require.NoError(t, token.Check(token.KeyPrefix, tok), "the token has the key prefix and a valid checksum")
	require.True(t, strings.HasPrefix(k.Id, "key_"))
	require.Equal(t, token.DisplayPrefix(token.KeyPrefix, tok), k.DisplayPrefix)
	require.Len(t, k.DisplayPrefix, len(token.KeyPrefix)+4)
	require.Equal(t, tok[len(tok)-4:], k.Last4)
	require.Equal(t, e.org, k.OrgId)
	require.Equal(t, team, k.TeamId)
	require.Equal(t, user, k.UserId)
	require.Equal(t, adminv1.TrafficClass_TRAFFIC_CLASS_AGENT, k.TrafficClass)
	require.Equal(t, "ok "+k.Id, e.authState(tok))

	got := e.get(k.Id)
	require.True(t, proto.Equal(k, got), "GetKey differs from CreateKey:\n%v\n%v", k, got)
	// The token never comes back once created.
	for proc, req := range map[string]string{
		"/sluice.admin.v1.KeyService/GetKey":   `{"id":"` + k.Id + `"}`,
		"/sluice.admin.v1.KeyService/ListKeys": `{}`,
	} {
		code, body := e.callJSON(e.bootstrap, proc, req)
		require.Equal(t, "ok", code, "%s: %s", proc, body)
		require.NotContains(t, string(body), tok)
		require.NotContains(t, string(body), tok[len(token.KeyPrefix):])
		require.Contains(t, string(body), k.Id)
	}

	upd, err := e.c.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
		Key:        &adminv1.Key{Id: k.Id, Alias: "ci-bot-2", Limits: &adminv1.Limits{RpmLimit: proto.Int64(120)}, TeamId: "ignored"},
		UpdateMask: keyMask("alias", "limits.rpm_limit"),
	}))
	require.NoError(t, err)
	require.Equal(t, "ci-bot-2", upd.Msg.Key.Alias)
	require.Equal(t, int64(120), upd.Msg.Key.Limits.GetRpmLimit())
	require.Equal(t, map[string]int64{"qwen-30b": 1000}, upd.Msg.Key.Limits.GetModelTpmLimit(), "fields outside the mask are kept")
	require.Equal(t, team, upd.Msg.Key.TeamId)
	require.Equal(t, "search", upd.Msg.Key.Project)

	bl, err := e.c.Key.BlockKey(e.ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: k.Id}))
	require.NoError(t, err)
	require.True(t, bl.Msg.Key.Blocked)
	require.Equal(t, "blocked key", e.authState(tok))
	ub, err := e.c.Key.UnblockKey(e.ctx, connect.NewRequest(&adminv1.UnblockKeyRequest{Id: k.Id}))
	require.NoError(t, err)
	require.False(t, ub.Msg.Key.Blocked)
	require.Equal(t, "ok "+k.Id, e.authState(tok))

	_, err = e.c.Key.RotateKey(e.ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: k.Id, GracePeriod: "1h"}))
	require.NoError(t, err)
	var oldHashes int
	require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT count(*) FROM key_old_hashes WHERE key_id = $1`, k.Id).Scan(&oldHashes))
	require.Equal(t, 1, oldHashes)

	_, err = e.c.Key.DeleteKey(e.ctx, connect.NewRequest(&adminv1.DeleteKeyRequest{Id: k.Id}))
	require.NoError(t, err)
	_, err = e.c.Key.GetKey(e.ctx, connect.NewRequest(&adminv1.GetKeyRequest{Id: k.Id}))
	require.Equal(t, "not_found", codeOf(err))
	require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT count(*) FROM key_old_hashes WHERE key_id = $1`, k.Id).Scan(&oldHashes))
	require.Zero(t, oldHashes, "old hashes go with the key")
	require.Equal(t, "unknown", e.authState(tok))

	require.Equal(t, []string{"created", "updated", "blocked", "unblocked", "rotated", "deleted"}, e.auditActions(k.Id),
		"exactly one audit row per mutation")
	require.Equal(t, auditBefore+6, e.auditCount())
	require.Equal(t, []string{"key.upserted", "key.upserted", "key.blocked", "key.unblocked", "key.rotated", "key.deleted"}, e.outbox(k.Id))

	// Failed calls write nothing.
	before := e.auditCount()
	_, err = e.c.Key.DeleteKey(e.ctx, connect.NewRequest(&adminv1.DeleteKeyRequest{Id: k.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = e.c.Key.BlockKey(e.ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: k.Id}))
	require.Equal(t, "not_found", codeOf(err))
	require.Equal(t, before, e.auditCount())
}

func TestCreateKeyScopeAndReferences(t *testing.T) {
	t.Parallel()
	e := newKeyEnv(t)
	other := e.mkOrg("other").Id
	team := e.team(e.org, "ml")
	otherTeam := e.team(other, "ml")
	otherUser := e.user(other, "bob@example.com")

	// Platform tokens must name the org.
	_, err := e.c.Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{Alias: "x"}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.Contains(t, err.Error(), "org_id")

	// Org tokens default to their org; team tokens to their team.
	orgTok := e.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_EDITOR, e.org, "")
	resp, err := e.as(orgTok).Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{Alias: "org-level"}))
	require.NoError(t, err)
	require.Equal(t, e.org, resp.Msg.Key.OrgId)
	require.Empty(t, resp.Msg.Key.TeamId)

	teamTok := e.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_EDITOR, e.org, team)
	resp, err = e.as(teamTok).Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{Alias: "team-level"}))
	require.NoError(t, err)
	require.Equal(t, e.org, resp.Msg.Key.OrgId)
	require.Equal(t, team, resp.Msg.Key.TeamId)

	before := e.auditCount()
	// A team token cannot create keys of another team, nor org-level keys
	// by naming its org explicitly with another team.
	other2 := e.team(e.org, "infra")
	_, err = e.as(teamTok).Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{TeamId: other2}))
	require.Equal(t, "permission_denied", codeOf(err))
	// An org token cannot create keys in another org.
	_, err = e.as(orgTok).Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: other}))
	require.Equal(t, "permission_denied", codeOf(err))

	// References are checked within the key's org.
	_, err = e.c.Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: e.org, TeamId: otherTeam}))
	require.Equal(t, "not_found", codeOf(err))
	require.Contains(t, err.Error(), "team "+otherTeam+" not found")
	_, err = e.c.Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: e.org, UserId: otherUser}))
	require.Equal(t, "not_found", codeOf(err))
	require.Contains(t, err.Error(), "user "+otherUser+" not found")
	_, err = e.c.Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: "org_missing"}))
	require.Equal(t, "not_found", codeOf(err))
	require.Contains(t, err.Error(), "org org_missing not found")
	require.Equal(t, before, e.auditCount(), "refused creations write nothing")
}

func TestCreateKeyValidationNamesTheField(t *testing.T) {
	t.Parallel()
	e := newKeyEnv(t)
	past := timestamppb.New(e.clock.Now().Add(-time.Second))
	long := strings.Repeat("a", 101)
	manyTags := make([]string, 65)
	for i := range manyTags {
		manyTags[i] = "t" + strings.Repeat("x", i%10) + string(rune('a'+i%26)) + string(rune('a'+i/26))
	}
	manyParams := make([]string, 33)
	for i := range manyParams {
		manyParams[i] = "p" + string(rune('a'+i%26)) + string(rune('a'+i/26))
	}
	cases := []struct {
		field string
		req   *adminv1.CreateKeyRequest
	}{
		{"alias", &adminv1.CreateKeyRequest{Alias: long}},
		{"project", &adminv1.CreateKeyRequest{Project: long}},
		{"expire_time", &adminv1.CreateKeyRequest{ExpireTime: past}},
		{"tags", &adminv1.CreateKeyRequest{Tags: manyTags}},
		{"tags[0]", &adminv1.CreateKeyRequest{Tags: []string{""}}},
		{"tags[0]", &adminv1.CreateKeyRequest{Tags: []string{"has space"}}},
		{"tags[0]", &adminv1.CreateKeyRequest{Tags: []string{strings.Repeat("t", 65)}}},
		{"tags[1]", &adminv1.CreateKeyRequest{Tags: []string{"a", "a"}}},
		{"traffic_class", &adminv1.CreateKeyRequest{TrafficClass: adminv1.TrafficClass(42)}},
		{"model_group_aliases[qwen]", &adminv1.CreateKeyRequest{ModelGroupAliases: map[string]string{"qwen": ""}}},
		{"enforced_params", &adminv1.CreateKeyRequest{EnforcedParams: manyParams}},
		{"enforced_params[0]", &adminv1.CreateKeyRequest{EnforcedParams: []string{"metadata..x"}}},
		{"enforced_params[0]", &adminv1.CreateKeyRequest{EnforcedParams: []string{"1user"}}},
		{"enforced_params[1]", &adminv1.CreateKeyRequest{EnforcedParams: []string{"user", "user"}}},
		{"allowed_routes[0]", &adminv1.CreateKeyRequest{AllowedRoutes: []string{"/v1/images/generations"}}},
		{"allowed_routes[1]", &adminv1.CreateKeyRequest{AllowedRoutes: []string{"/v1/models", "/v1/models"}}},
		{"limits.rpm_limit", &adminv1.CreateKeyRequest{Limits: &adminv1.Limits{RpmLimit: proto.Int64(0)}}},
		{"limits.budget_duration", &adminv1.CreateKeyRequest{Limits: &adminv1.Limits{MaxBudget: proto.Float64(5)}}},
		{"limits.rate_limit_fallback", &adminv1.CreateKeyRequest{Limits: &adminv1.Limits{RateLimitFallback: "open"}}},
		{"limits.model_max_budget[m]", &adminv1.CreateKeyRequest{Limits: &adminv1.Limits{ModelMaxBudget: map[string]float64{"m": -1}, BudgetDuration: "1d"}}},
		{"metadata", &adminv1.CreateKeyRequest{Metadata: map[string]string{"": "x"}}},
		{"user_id", &adminv1.CreateKeyRequest{UserId: strings.Repeat("u", 200)}},
	}
	before := e.auditCount()
	for _, tc := range cases {
		tc.req.OrgId = e.org
		_, err := e.c.Key.CreateKey(e.ctx, connect.NewRequest(tc.req))
		require.Equal(t, "invalid_argument", codeOf(err), "%s: %v", tc.field, err)
		require.Contains(t, err.Error(), tc.field+":", "the message names the field")
	}
	require.Equal(t, before, e.auditCount())

	// Per-model limits are allowed on keys, and every valid field is kept.
	k, _ := e.create(&adminv1.CreateKeyRequest{
		ExpireTime:     timestamppb.New(e.clock.Now().Add(time.Hour)),
		EnforcedParams: []string{"metadata.generation_name", "_x"},
		AllowedRoutes:  []string{"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models"},
		Tags:           []string{"a-b_c.d:e/f"},
		Limits: &adminv1.Limits{
			MaxBudget: proto.Float64(10), SoftBudget: proto.Float64(5), BudgetDuration: "30d",
			ModelMaxBudget: map[string]float64{"qwen": 2}, ModelRpmLimit: map[string]int64{"qwen": 5},
			AllowedModels: []string{"qwen"}, MaxParallelRequests: proto.Int64(3), TpmLimit: proto.Int64(1000),
		},
	})
	got := e.get(k.Id)
	require.Equal(t, e.clock.Now().Add(time.Hour), got.ExpireTime.AsTime())
	require.Equal(t, map[string]float64{"qwen": 2}, got.Limits.ModelMaxBudget)
	require.Equal(t, []string{"metadata.generation_name", "_x"}, got.EnforcedParams)
	require.Len(t, got.AllowedRoutes, 4)
}

func TestUpdateKeyMask(t *testing.T) {
	t.Parallel()
	e := newKeyEnv(t)
	team := e.team(e.org, "ml")
	user := e.user(e.org, "ada@example.com")
	e.member(e.org, team, user)
	other := e.mkOrg("other").Id
	otherUser := e.user(other, "bob@example.com")
	k, tok := e.create(&adminv1.CreateKeyRequest{TeamId: team, Alias: "a", ExpireTime: timestamppb.New(e.clock.Now().Add(time.Minute))})

	before := e.auditCount()
	for _, path := range []string{"team_id", "org_id", "blocked", "display_prefix", "last4", "rotation_count", "nope"} {
		_, err := e.c.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{Key: &adminv1.Key{Id: k.Id}, UpdateMask: keyMask(path)}))
		require.Equal(t, "invalid_argument", codeOf(err), path)
		require.Contains(t, err.Error(), "update_mask")
	}
	_, err := e.c.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{Key: &adminv1.Key{Id: k.Id, Alias: "b"}}))
	require.Equal(t, "invalid_argument", codeOf(err), "an empty mask is refused")
	_, err = e.c.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
		Key: &adminv1.Key{Id: k.Id, UserId: otherUser}, UpdateMask: keyMask("user_id"),
	}))
	require.Equal(t, "failed_precondition", codeOf(err), "a team key's owner must be a member of its team")
	require.Contains(t, err.Error(), "user "+otherUser+" is not a member of team "+team)
	_, err = e.c.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
		Key: &adminv1.Key{Id: k.Id, ExpireTime: timestamppb.New(e.clock.Now())}, UpdateMask: keyMask("expire_time"),
	}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.Contains(t, err.Error(), "expire_time")
	_, err = e.c.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
		Key: &adminv1.Key{Id: k.Id, Tags: []string{"bad tag"}}, UpdateMask: keyMask("tags"),
	}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.Contains(t, err.Error(), "tags[0]")
	require.Equal(t, before, e.auditCount())

	// Once expired, the key's other fields can still be edited.
	e.clock.Advance(2 * time.Minute)
	require.Equal(t, "expired", e.authState(tok))
	upd, err := e.c.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
		Key:        &adminv1.Key{Id: k.Id, UserId: user, Tags: []string{"x"}, TrafficClass: adminv1.TrafficClass_TRAFFIC_CLASS_BATCH},
		UpdateMask: keyMask("user_id", "tags", "traffic_class"),
	}))
	require.NoError(t, err)
	require.Equal(t, user, upd.Msg.Key.UserId)
	require.Equal(t, adminv1.TrafficClass_TRAFFIC_CLASS_BATCH, upd.Msg.Key.TrafficClass)
	require.NotNil(t, upd.Msg.Key.ExpireTime)

	// Clearing expire_time (in the mask, unset in the key) revives it.
	upd, err = e.c.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
		Key: &adminv1.Key{Id: k.Id}, UpdateMask: keyMask("expire_time", "user_id"),
	}))
	require.NoError(t, err)
	require.Nil(t, upd.Msg.Key.ExpireTime)
	require.Empty(t, upd.Msg.Key.UserId)
	require.Equal(t, "ok "+k.Id, e.authState(tok))
	require.Equal(t, before+2, e.auditCount())
	require.Equal(t, []string{"key.upserted", "key.upserted", "key.upserted"}, e.outbox(k.Id))
}

func TestRotateKeyWithGrace(t *testing.T) {
	t.Parallel()
	e := newKeyEnv(t)
	limits := &adminv1.Limits{MaxBudget: proto.Float64(50), BudgetDuration: "30d", RpmLimit: proto.Int64(100)}
	k, oldTok := e.create(&adminv1.CreateKeyRequest{Alias: "svc", Limits: limits, Tags: []string{"prod"}})

	e.clock.Advance(time.Minute)
	now := e.clock.Now()
	resp, err := e.c.Key.RotateKey(e.ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: k.Id, GracePeriod: "15m"}))
	require.NoError(t, err)
	newTok := resp.Msg.Token
	rk := resp.Msg.Key
	require.NoError(t, token.Check(token.KeyPrefix, newTok))
	require.NotEqual(t, oldTok, newTok)
	require.Equal(t, k.Id, rk.Id, "rotation keeps the key record")
	require.Equal(t, int64(1), rk.RotationCount)
	require.Equal(t, now, rk.RotateTime.AsTime())
	require.Equal(t, token.Last4(newTok), rk.Last4)
	require.Equal(t, token.DisplayPrefix(token.KeyPrefix, newTok), rk.DisplayPrefix)
	require.True(t, proto.Equal(limits, rk.Limits), "limits are kept")
	require.Equal(t, []string{"prod"}, rk.Tags)
	require.Equal(t, k.CreateTime.AsTime(), rk.CreateTime.AsTime())
	require.Equal(t, now.Add(15*time.Minute), resp.Msg.OldTokenValidUntil.AsTime())
	got := e.get(k.Id)
	require.True(t, proto.Equal(rk, got), "GetKey differs from RotateKey:\n%v\n%v", rk, got)

	require.Equal(t, "ok "+k.Id, e.authState(newTok))
	require.Equal(t, "ok "+k.Id, e.authState(oldTok), "the old token works during the grace period")
	e.clock.Advance(15*time.Minute - time.Microsecond)
	require.Equal(t, "ok "+k.Id, e.authState(oldTok))
	e.clock.Advance(time.Microsecond)
	require.Equal(t, "unknown", e.authState(oldTok), "and not after it")
	require.Equal(t, "ok "+k.Id, e.authState(newTok))

	require.Equal(t, []string{"created", "rotated"}, e.auditActions(k.Id))
	require.Equal(t, []string{"key.upserted", "key.rotated"}, e.outbox(k.Id))
	require.JSONEq(t, `{"grace_until":"`+now.Add(15*time.Minute).Format(time.RFC3339Nano)+`"}`, e.lastPayload(k.Id))
	// The rotation's audit record carries the grace given.
	var after map[string]any
	var afterJSON string
	require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT after_json FROM audit_log WHERE object_id = $1 AND action = 'rotated' ORDER BY seq DESC LIMIT 1`, k.Id).Scan(&afterJSON))
	require.NoError(t, json.Unmarshal([]byte(afterJSON), &after))
	require.Equal(t, "15m0s", after["grace_period"])
	require.Equal(t, now.Add(15*time.Minute).Format(time.RFC3339Nano), after["old_token_valid_until"])
	require.Equal(t, k.Id, after["id"])

	// A second rotation drops the old hash whose grace has ended and counts on.
	resp, err = e.c.Key.RotateKey(e.ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: k.Id, GracePeriod: "7d"}))
	require.NoError(t, err)
	require.Equal(t, int64(2), resp.Msg.Key.RotationCount)
	require.Equal(t, e.clock.Now().Add(7*24*time.Hour), resp.Msg.OldTokenValidUntil.AsTime())
	var n int
	require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT count(*) FROM key_old_hashes WHERE key_id = $1`, k.Id).Scan(&n))
	require.Equal(t, 1, n)
	require.Equal(t, "ok "+k.Id, e.authState(newTok))
	require.Equal(t, "ok "+k.Id, e.authState(resp.Msg.Token))
}

func TestRotateKeyWithoutGrace(t *testing.T) {
	t.Parallel()
	e := newKeyEnv(t)
	k, tok0 := e.create(&adminv1.CreateKeyRequest{})

	// A rotation with grace, then an immediate one: every earlier token
	// stops at once, including the one still in its grace period.
	r1, err := e.c.Key.RotateKey(e.ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: k.Id, GracePeriod: "1h"}))
	require.NoError(t, err)
	require.Equal(t, "ok "+k.Id, e.authState(tok0))
	for i, grace := range []string{"", "0s"} {
		resp, err := e.c.Key.RotateKey(e.ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: k.Id, GracePeriod: grace}))
		require.NoError(t, err, grace)
		require.Nil(t, resp.Msg.OldTokenValidUntil)
		require.Equal(t, int64(i+2), resp.Msg.Key.RotationCount)
		require.Equal(t, "unknown", e.authState(tok0), grace)
		require.Equal(t, "unknown", e.authState(r1.Msg.Token), grace)
		require.Equal(t, "ok "+k.Id, e.authState(resp.Msg.Token))
		require.JSONEq(t, `{}`, e.lastPayload(k.Id))
		r1 = resp
	}
	var n int
	require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT count(*) FROM key_old_hashes WHERE key_id = $1`, k.Id).Scan(&n))
	require.Zero(t, n)
}

func TestRotateKeyRejectsBadGrace(t *testing.T) {
	t.Parallel()
	e := newKeyEnv(t)
	k, tok := e.create(&adminv1.CreateKeyRequest{})
	before := e.auditCount()
	outboxBefore := e.outbox(k.Id)
	for _, grace := range []string{"abc", "-5m", "31d", "1y", "721h", "1.5d", "7 d", "-0d"} {
		_, err := e.c.Key.RotateKey(e.ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: k.Id, GracePeriod: grace}))
		require.Equal(t, "invalid_argument", codeOf(err), "%q", grace)
		require.Contains(t, err.Error(), "grace_period", "%q", grace)
	}
	got := e.get(k.Id)
	require.Equal(t, k.Last4, got.Last4, "nothing rotated")
	require.Zero(t, got.RotationCount)
	require.Nil(t, got.RotateTime)
	require.Equal(t, before, e.auditCount(), "no audit row")
	require.Equal(t, outboxBefore, e.outbox(k.Id), "no outbox row")
	require.Equal(t, "ok "+k.Id, e.authState(tok))
}

func TestParseGracePeriod(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]time.Duration{
		"": 0, "0s": 0, "0": 0, "90s": 90 * time.Second, "15m": 15 * time.Minute, "24h": 24 * time.Hour,
		"1h30m": 90 * time.Minute, "7d": 7 * 24 * time.Hour, "30d": 30 * 24 * time.Hour, "720h": 720 * time.Hour, "0d": 0,
	} {
		got, err := parseGracePeriod(in)
		require.NoError(t, err, "%q", in)
		require.Equal(t, want, got, "%q", in)
	}
	for _, in := range []string{"abc", "-5m", "-1s", "31d", "1y", "720h1ns", "1.5d", "d", "99999d", "7D", " 7d"} {
		_, err := parseGracePeriod(in)
		require.Error(t, err, "%q", in)
		var ve *ValidationError
		require.ErrorAs(t, err, &ve)
		require.Equal(t, "grace_period", ve.Violations[0].Field)
	}
}

func TestKeyExportExpiryAndBlocks(t *testing.T) {
	t.Parallel()
	e := newKeyEnv(t)
	team := e.team(e.org, "ml")
	user := e.user(e.org, "ada@example.com")

	exp, expTok := e.create(&adminv1.CreateKeyRequest{ExpireTime: timestamppb.New(e.clock.Now().Add(time.Hour))})
	require.Equal(t, "ok "+exp.Id, e.authState(expTok))
	e.clock.Advance(time.Hour)
	require.Equal(t, "expired", e.authState(expTok))

	e.member(e.org, team, user)
	k, tok := e.create(&adminv1.CreateKeyRequest{TeamId: team, UserId: user})
	require.Equal(t, "ok "+k.Id, e.authState(tok))
	e.exec(`UPDATE users SET blocked = true WHERE id = $1`, user)
	require.Equal(t, "blocked user", e.authState(tok))
	e.exec(`UPDATE teams SET blocked = true WHERE id = $1`, team)
	require.Equal(t, "blocked team", e.authState(tok), "the widest blocked scope is named")
	_, err := e.c.Org.BlockOrg(e.ctx, connect.NewRequest(&adminv1.BlockOrgRequest{Id: e.org}))
	require.NoError(t, err)
	require.Equal(t, "blocked org", e.authState(tok))
	_, err = e.c.Org.UnblockOrg(e.ctx, connect.NewRequest(&adminv1.UnblockOrgRequest{Id: e.org}))
	require.NoError(t, err)
	e.exec(`UPDATE teams SET blocked = false WHERE id = $1`, team)
	e.exec(`UPDATE users SET blocked = false WHERE id = $1`, user)
	require.Equal(t, "ok "+k.Id, e.authState(tok))

	recs, err := e.store.KeyAuthRecords(e.ctx)
	require.NoError(t, err)
	require.Len(t, recs, 2)
	for _, r := range recs {
		require.Equal(t, e.org, r.OrgID)
		require.Equal(t, e.peppers.Current(), r.PepperVersion)
		require.Len(t, r.Hash, 32)
		if r.KeyID == k.Id {
			require.Equal(t, team, r.TeamID)
			require.Equal(t, user, r.UserID)
			require.Nil(t, r.ExpiresAt)
		}
	}
}

func TestKeyTokensAreNeverStoredOrLogged(t *testing.T) {
	t.Parallel()
	e := newKeyEnv(t)
	team := e.team(e.org, "ml")
	k, tok := e.create(&adminv1.CreateKeyRequest{TeamId: team, Alias: "secret-check"})
	rot, err := e.c.Key.RotateKey(e.ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: k.Id, GracePeriod: "1h"}))
	require.NoError(t, err)
	_, err = e.c.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{Key: &adminv1.Key{Id: k.Id, Alias: "x"}, UpdateMask: keyMask("alias")}))
	require.NoError(t, err)
	_, err = e.c.Key.BlockKey(e.ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: k.Id}))
	require.NoError(t, err)

	dump, err := exec.Command("pg_dump", "--data-only", e.dbURL).CombinedOutput()
	require.NoError(t, err, "pg_dump: %s", dump)
	require.Contains(t, string(dump), k.Id, "the dump holds the key")
	logs := e.logs.String()
	require.Contains(t, logs, "KeyService/RotateKey", "the calls were logged")
	for _, secret := range []string{tok, rot.Msg.Token} {
		body := secret[len(token.KeyPrefix):]
		for _, needle := range []string{secret, body, body[:43]} {
			require.NotContains(t, string(dump), needle, "database dump")
			require.NotContains(t, logs, needle, "logs")
		}
	}
}

func TestKeyTenantIsolation(t *testing.T) {
	t.Parallel()
	e := newKeyEnv(t)
	teamA := e.team(e.org, "a")
	teamB := e.team(e.org, "b")
	keyA, _ := e.create(&adminv1.CreateKeyRequest{TeamId: teamA, Alias: "a"})
	keyB, _ := e.create(&adminv1.CreateKeyRequest{TeamId: teamB, Alias: "b"})
	orgKey, _ := e.create(&adminv1.CreateKeyRequest{Alias: "org"})

	other := e.mkOrg("other").Id
	otherTok := e.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, other, "")
	teamTok := e.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_ADMIN, e.org, teamA)
	viewer := e.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_VIEWER, e.org, "")

	mutations := func(c clients, id string) map[string]error {
		_, errU := c.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{Key: &adminv1.Key{Id: id, Alias: "z"}, UpdateMask: keyMask("alias")}))
		_, errR := c.Key.RotateKey(e.ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: id, GracePeriod: "1h"}))
		_, errB := c.Key.BlockKey(e.ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: id}))
		_, errUB := c.Key.UnblockKey(e.ctx, connect.NewRequest(&adminv1.UnblockKeyRequest{Id: id}))
		_, errD := c.Key.DeleteKey(e.ctx, connect.NewRequest(&adminv1.DeleteKeyRequest{Id: id}))
		_, errG := c.Key.GetKey(e.ctx, connect.NewRequest(&adminv1.GetKeyRequest{Id: id}))
		return map[string]error{"update": errU, "rotate": errR, "block": errB, "unblock": errUB, "delete": errD, "get": errG}
	}
	before := e.auditCount()

	// Another org's admin: the keys do not exist for it.
	for _, id := range []string{keyA.Id, keyB.Id, orgKey.Id} {
		for op, err := range mutations(e.as(otherTok), id) {
			require.Equal(t, "not_found", codeOf(err), "org B %s of %s", op, id)
		}
	}
	_, err := e.as(otherTok).Key.ListKeys(e.ctx, connect.NewRequest(&adminv1.ListKeysRequest{OrgId: e.org}))
	require.Equal(t, "permission_denied", codeOf(err))
	list, err := e.as(otherTok).Key.ListKeys(e.ctx, connect.NewRequest(&adminv1.ListKeysRequest{}))
	require.NoError(t, err)
	require.Empty(t, list.Msg.Keys)
	_, err = e.as(otherTok).Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: e.org}))
	require.Equal(t, "permission_denied", codeOf(err))

	// A team token: neither another team's key nor an org-level key.
	for _, id := range []string{keyB.Id, orgKey.Id} {
		for op, err := range mutations(e.as(teamTok), id) {
			require.Equal(t, "not_found", codeOf(err), "team A %s of %s", op, id)
		}
	}
	_, err = e.as(teamTok).Key.ListKeys(e.ctx, connect.NewRequest(&adminv1.ListKeysRequest{TeamId: teamB}))
	require.Equal(t, "permission_denied", codeOf(err))
	list, err = e.as(teamTok).Key.ListKeys(e.ctx, connect.NewRequest(&adminv1.ListKeysRequest{}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Keys, 1)
	require.Equal(t, keyA.Id, list.Msg.Keys[0].Id)

	// A viewer reads but never changes.
	for op, err := range mutations(e.as(viewer), keyA.Id) {
		if op == "get" {
			require.NoError(t, err)
			continue
		}
		require.Equal(t, "permission_denied", codeOf(err), "viewer %s", op)
	}
	_, err = e.as(viewer).Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = e.as(viewer).Key.RotateKey(e.ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: keyA.Id, GracePeriod: "bogus"}))
	require.Equal(t, "permission_denied", codeOf(err), "a viewer learns nothing from validation")
	list, err = e.as(viewer).Key.ListKeys(e.ctx, connect.NewRequest(&adminv1.ListKeysRequest{}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Keys, 3)
	require.Equal(t, before, e.auditCount(), "refused calls write no audit rows")

	// The team token does manage its own team's keys.
	for op, err := range mutations(e.as(teamTok), keyA.Id) {
		if op == "get" {
			require.Equal(t, "not_found", codeOf(err), "deleted just before")
			continue
		}
		require.NoError(t, err, "team A %s of its own key", op)
	}
	require.Equal(t, before+5, e.auditCount())
	require.Equal(t, []string{"key.upserted", "key.upserted", "key.rotated", "key.blocked", "key.unblocked", "key.deleted"}, e.outbox(keyA.Id))
}

func TestListKeysFilters(t *testing.T) {
	t.Parallel()
	e := newKeyEnv(t)
	team := e.team(e.org, "ml")
	user := e.user(e.org, "ada@example.com")
	other := e.mkOrg("other").Id
	a, _ := e.create(&adminv1.CreateKeyRequest{TeamId: team, Alias: "bot-1", Tags: []string{"prod"}})
	b, _ := e.create(&adminv1.CreateKeyRequest{UserId: user, Alias: "bot-2", Tags: []string{"dev", "prod"}})
	c, _ := e.create(&adminv1.CreateKeyRequest{Alias: "human"})
	d, _ := e.create(&adminv1.CreateKeyRequest{OrgId: other, Alias: "bot-3"})
	_, err := e.c.Key.BlockKey(e.ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: c.Id}))
	require.NoError(t, err)

	ids := func(req *adminv1.ListKeysRequest) []string {
		t.Helper()
		resp, err := e.c.Key.ListKeys(e.ctx, connect.NewRequest(req))
		require.NoError(t, err)
		var out []string
		for _, k := range resp.Msg.Keys {
			out = append(out, k.Id)
		}
		return out
	}
	require.Equal(t, []string{a.Id, b.Id, c.Id, d.Id}, ids(&adminv1.ListKeysRequest{}))
	require.Equal(t, []string{a.Id, b.Id, c.Id}, ids(&adminv1.ListKeysRequest{OrgId: e.org}))
	require.Equal(t, []string{a.Id}, ids(&adminv1.ListKeysRequest{TeamId: team}))
	require.Equal(t, []string{b.Id}, ids(&adminv1.ListKeysRequest{UserId: user}))
	require.Equal(t, []string{a.Id, b.Id, d.Id}, ids(&adminv1.ListKeysRequest{AliasPrefix: "bot-"}))
	require.Equal(t, []string{c.Id}, ids(&adminv1.ListKeysRequest{Blocked: proto.Bool(true)}))
	require.Equal(t, []string{a.Id, b.Id, d.Id}, ids(&adminv1.ListKeysRequest{Blocked: proto.Bool(false)}))
	require.Equal(t, []string{a.Id, b.Id}, ids(&adminv1.ListKeysRequest{Tag: "prod"}))
	require.Equal(t, []string{b.Id}, ids(&adminv1.ListKeysRequest{Tag: "dev"}))

	var paged []string
	tok := ""
	for {
		resp, err := e.c.Key.ListKeys(e.ctx, connect.NewRequest(&adminv1.ListKeysRequest{PageSize: 3, PageToken: tok}))
		require.NoError(t, err)
		for _, k := range resp.Msg.Keys {
			paged = append(paged, k.Id)
		}
		if tok = resp.Msg.NextPageToken; tok == "" {
			break
		}
	}
	require.Equal(t, []string{a.Id, b.Id, c.Id, d.Id}, paged)

	for field, req := range map[string]*adminv1.ListKeysRequest{
		"tag":          {Tag: "bad tag"},
		"alias_prefix": {AliasPrefix: strings.Repeat("a", 101)},
		"page_size":    {PageSize: -1},
	} {
		_, err := e.c.Key.ListKeys(e.ctx, connect.NewRequest(req))
		require.Equal(t, "invalid_argument", codeOf(err), field)
		require.Contains(t, err.Error(), field)
	}
}

// TestKeyOwnerMustBeATeamMember: a key draws on its owner's budget, so a
// team key may only be owned (created with, or re-owned to, user_id) by a
// member of its team, and an org key by a user of its org. The rule is
// the same for every caller, team editors and platform admins alike.
func TestKeyOwnerMustBeATeamMember(t *testing.T) {
	t.Parallel()
	e := newKeyEnv(t)
	team := e.team(e.org, "ml")
	otherTeam := e.team(e.org, "infra")
	member := e.user(e.org, "member@example.com")
	outsider := e.user(e.org, "outsider@example.com") // in the org, not in team ml
	foreign := e.user(e.mkOrg("other").Id, "foreign@example.com")
	_, err := e.c.Team.AddTeamMember(e.ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: team, UserId: member}))
	require.NoError(t, err)
	_, err = e.c.Team.AddTeamMember(e.ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: otherTeam, UserId: outsider}))
	require.NoError(t, err)

	teamEditor := e.as(e.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_EDITOR, e.org, team))
	orgEditor := e.as(e.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_EDITOR, e.org, ""))
	before := e.auditCount()
	for _, who := range []struct {
		name string
		c    clients
	}{{"team editor", teamEditor}, {"org editor", orgEditor}, {"platform admin", e.c}} {
		for _, u := range []string{outsider, foreign, "user_missing"} {
			_, err := who.c.Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: e.org, TeamId: team, UserId: u}))
			require.Equal(t, "failed_precondition", codeOf(err), "%s: team key owned by %s", who.name, u)
			require.Contains(t, err.Error(), "user_id: user "+u+" is not a member of team "+team)
		}
	}
	require.Equal(t, before, e.auditCount(), "refused creations write nothing")

	// Members may own the team's keys.
	k, err := teamEditor.Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{UserId: member, Alias: "mine"}))
	require.NoError(t, err)
	require.Equal(t, member, k.Msg.Key.UserId)
	require.Equal(t, team, k.Msg.Key.TeamId)

	// Re-owning follows the same rule.
	reown := func(c clients, user string) error {
		_, err := c.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
			Key: &adminv1.Key{Id: k.Msg.Key.Id, UserId: user}, UpdateMask: keyMask("user_id"),
		}))
		return err
	}
	before = e.auditCount()
	for _, c := range []clients{teamEditor, orgEditor, e.c} {
		err := reown(c, outsider)
		require.Equal(t, "failed_precondition", codeOf(err))
		require.Contains(t, err.Error(), "user "+outsider+" is not a member of team "+team)
	}
	require.Equal(t, before, e.auditCount())
	require.NoError(t, reown(teamEditor, ""), "clearing the owner is always allowed")
	require.NoError(t, reown(teamEditor, member))
	require.Equal(t, member, e.get(k.Msg.Key.Id).UserId)

	// Org keys (no team): any user of the org, never one of another org.
	ok, err := orgEditor.Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{UserId: outsider}))
	require.NoError(t, err)
	require.Equal(t, outsider, ok.Msg.Key.UserId)
	_, err = orgEditor.Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{UserId: foreign}))
	require.Equal(t, "not_found", codeOf(err))
	require.Contains(t, err.Error(), "user "+foreign+" not found")
	_, err = orgEditor.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
		Key: &adminv1.Key{Id: ok.Msg.Key.Id, UserId: foreign}, UpdateMask: keyMask("user_id"),
	}))
	require.Equal(t, "not_found", codeOf(err))
}

// TestKeyProjectFollowsTheProjectScopeRule: a key accepts as its project
// (and its tags) exactly what a label scope accepts as a name, so every
// key's project and tags can be given limits.
func TestKeyProjectFollowsTheProjectScopeRule(t *testing.T) {
	t.Parallel()
	e := newKeyEnv(t)
	k, _ := e.create(&adminv1.CreateKeyRequest{Project: "search"})
	// (Invalid UTF-8 cannot travel in a proto string: it is not sent.)
	bad := []string{"a\x00b", "tab\there", "line\nbreak", "\x7f", " lead", "trail ", strings.Repeat("p", 101)}
	before := e.auditCount()
	for _, name := range bad {
		_, err := e.c.LabelScope.CreateLabelScope(e.ctx, connect.NewRequest(&adminv1.CreateLabelScopeRequest{
			OrgId: e.org, Kind: adminv1.LabelScopeKind_LABEL_SCOPE_KIND_PROJECT, Name: name,
		}))
		require.Equal(t, "invalid_argument", codeOf(err), "scope %q", name)
		require.Contains(t, err.Error(), "name:", "scope %q", name)

		_, err = e.c.Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: e.org, Project: name}))
		require.Equal(t, "invalid_argument", codeOf(err), "create %q", name)
		require.Contains(t, err.Error(), "project:", "create %q", name)

		_, err = e.c.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
			Key: &adminv1.Key{Id: k.Id, Project: name}, UpdateMask: keyMask("project"),
		}))
		require.Equal(t, "invalid_argument", codeOf(err), "update %q", name)
		require.Contains(t, err.Error(), "project:", "update %q", name)
	}
	require.Equal(t, before, e.auditCount(), "refused requests write nothing")
	require.Equal(t, "search", e.get(k.Id).GetProject())

	// What a scope accepts, a key accepts, as its project and as a tag.
	for _, name := range []string{"Team Alpha/β", "a", strings.Repeat("p", 100)} {
		_, err := e.c.LabelScope.CreateLabelScope(e.ctx, connect.NewRequest(&adminv1.CreateLabelScopeRequest{
			OrgId: e.org, Kind: adminv1.LabelScopeKind_LABEL_SCOPE_KIND_PROJECT, Name: name,
		}))
		require.NoError(t, err, name)
		resp, err := e.c.Key.UpdateKey(e.ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
			Key: &adminv1.Key{Id: k.Id, Project: name}, UpdateMask: keyMask("project"),
		}))
		require.NoError(t, err, name)
		require.Equal(t, name, resp.Msg.GetKey().GetProject())
	}
	_, err := e.c.LabelScope.CreateLabelScope(e.ctx, connect.NewRequest(&adminv1.CreateLabelScopeRequest{
		OrgId: e.org, Kind: adminv1.LabelScopeKind_LABEL_SCOPE_KIND_TAG, Name: "bad tag",
	}))
	require.Equal(t, "invalid_argument", codeOf(err))
	_, err = e.c.Key.CreateKey(e.ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: e.org, Tags: []string{"bad tag"}}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.Contains(t, err.Error(), "tags[0]:")
}
