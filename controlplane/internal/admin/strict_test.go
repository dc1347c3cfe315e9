package admin

import (
	"context"
	"encoding/json"
	"sort"
	"strconv"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// inputType is the request message type of an admin procedure.
func inputType(t *testing.T, procedure string) protoreflect.MessageType {
	t.Helper()
	parts := strings.Split(strings.TrimPrefix(procedure, "/"), "/")
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(parts[0]))
	require.NoError(t, err, procedure)
	md := d.(protoreflect.ServiceDescriptor).Methods().ByName(protoreflect.Name(parts[1]))
	require.NotNil(t, md, procedure)
	mt, err := protoregistry.GlobalTypes.FindMessageByName(md.Input().FullName())
	require.NoError(t, err, procedure)
	return mt
}

// misspell renames the first (sorted) top-level key of a JSON request by
// doubling its last letter, or adds a field to an empty request, and
// returns the new body and the misspelled name.
func misspell(t *testing.T, body string) (string, string) {
	t.Helper()
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal([]byte(body), &m))
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	bad := "page_sizee"
	if len(keys) > 0 {
		k := keys[0]
		bad = k + k[len(k)-1:]
		m[bad] = m[k]
		delete(m, k)
	} else {
		m[bad] = json.RawMessage(`10`)
	}
	out, err := json.Marshal(m)
	require.NoError(t, err)
	return string(out), bad
}

// TestUnknownFieldIsInvalidArgumentOnEveryRPC sends every admin RPC
// (enumerated from the generated descriptors, so a new RPC is covered
// without touching this test) a valid request with one field
// misspelled, in Connect JSON, and the same valid request with an
// unknown field number appended, in binary protobuf: each answers
// InvalidArgument naming the field, and nothing is audited.
func TestUnknownFieldIsInvalidArgumentOnEveryRPC(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fx := b.mkFixture("strict")
	before := b.auditCount()
	for _, r := range adminRPCs(t) {
		build := builders[r.method]
		if build == nil {
			t.Errorf("%s: no request builder in rpcmatrix_test.go", r.procedure)
			continue
		}
		valid := build(fx.team1)
		body, bad := misspell(t, valid)
		code, msg := b.post(r.procedure, "application/json", []byte(body))
		if code != "invalid_argument" || !strings.Contains(msg, bad+": unknown field") {
			t.Errorf("%s JSON %s: got %s %q, want invalid_argument naming %q", r.procedure, body, code, msg, bad)
		}

		m := inputType(t, r.procedure).New().Interface()
		require.NoError(t, protojson.Unmarshal([]byte(valid), m), "%s: %s", r.procedure, valid)
		bin, err := proto.Marshal(m)
		require.NoError(t, err)
		bin = protowire.AppendVarint(protowire.AppendTag(bin, 999, protowire.VarintType), 1)
		code, msg = b.post(r.procedure, "application/proto", bin)
		if code != "invalid_argument" || !strings.Contains(msg, "unknown field number 999") {
			t.Errorf("%s binary: got %s %q, want invalid_argument naming field number 999", r.procedure, code, msg)
		}
	}
	require.Equal(t, before, b.auditCount(), "refused requests must not be audited")
}

// TestUnknownNestedFieldsAreNamedByPath covers the cases: a
// misspelled limit inside a nested message, and RotateKey's "grace".
func TestUnknownNestedFieldsAreNamedByPath(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fx := b.mkFixture("nested")
	code, msg := b.post("/sluice.admin.v1.TeamService/CreateTeam", "application/json",
		[]byte(`{"org_id":"`+fx.team1.OrgID+`","name":"t-`+u()+`","limits":{"max_paralel_requests":3}}`))
	require.Equal(t, "invalid_argument", code, msg)
	require.Contains(t, msg, "limits.max_paralel_requests: unknown field")

	code, msg = b.post("/sluice.admin.v1.KeyService/RotateKey", "application/json",
		[]byte(`{"id":"`+fx.team1.KeyID+`","grace":"24h"}`))
	require.Equal(t, "invalid_argument", code, msg)
	require.Contains(t, msg, "grace: unknown field")

	// A model group's routing settings: unknown members are named by path,
	// an unknown strategy name is a validation error naming the field.
	code, msg = b.post("/sluice.admin.v1.ModelService/CreateModelGroup", "application/json",
		[]byte(`{"name":"mg-`+u()+`","routing":{"strategy":"affinity","sesion_ttl":"60s"}}`))
	require.Equal(t, "invalid_argument", code, msg)
	require.Contains(t, msg, "routing.sesion_ttl: unknown field")
	code, msg = b.post("/sluice.admin.v1.ModelService/CreateModelGroup", "application/json",
		[]byte(`{"name":"mg-`+u()+`","routing":{"strategy":"least_loaded"}}`))
	require.Equal(t, "invalid_argument", code, msg)
	require.Contains(t, msg, "routing.strategy: unknown strategy")

	// Nested binary: an unknown field inside limits.
	lim, err := proto.Marshal(&adminv1.Limits{RpmLimit: proto.Int64(5)})
	require.NoError(t, err)
	lim = protowire.AppendVarint(protowire.AppendTag(lim, 77, protowire.VarintType), 3)
	req, err := proto.Marshal(&adminv1.CreateTeamRequest{OrgId: fx.team1.OrgID, Name: "t-" + u()})
	require.NoError(t, err)
	req = protowire.AppendBytes(protowire.AppendTag(req, 3, protowire.BytesType), lim)
	code, msg = b.post("/sluice.admin.v1.TeamService/CreateTeam", "application/proto", req)
	require.Equal(t, "invalid_argument", code, msg)
	require.Contains(t, msg, "limits: unknown field number 77")
}

// TestUpdateMaskTakesProtoAndJSONNames updates a team's rpm limit with
// the mask spelled both ways, over Connect JSON and over binary.
func TestUpdateMaskTakesProtoAndJSONNames(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fx := b.mkFixture("mask")
	for i, path := range []string{"limits.rpm_limit", "limits.rpmLimit"} {
		n := 100 + i
		code, out := b.callJSON(b.bootstrap, "/sluice.admin.v1.TeamService/UpdateTeam",
			`{"team":{"id":"`+fx.team1.TeamID+`","limits":{"rpm_limit":`+strconv.Itoa(i*10+1)+`}},"update_mask":"`+path+`"}`)
		require.Equal(t, "ok", code, "JSON mask %s: %s", path, out)
		got, err := b.root().Team.GetTeam(context.Background(), connect.NewRequest(&adminv1.GetTeamRequest{Id: fx.team1.TeamID}))
		require.NoError(t, err)
		require.Equal(t, int64(i*10+1), got.Msg.Team.GetLimits().GetRpmLimit(), "JSON mask %s", path)

		_, err = b.root().Team.UpdateTeam(context.Background(), connect.NewRequest(&adminv1.UpdateTeamRequest{
			Team:       &adminv1.Team{Id: fx.team1.TeamID, Limits: &adminv1.Limits{RpmLimit: proto.Int64(int64(n))}},
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{path}},
		}))
		require.NoError(t, err, "binary mask %s", path)
		got, err = b.root().Team.GetTeam(context.Background(), connect.NewRequest(&adminv1.GetTeamRequest{Id: fx.team1.TeamID}))
		require.NoError(t, err)
		require.Equal(t, int64(n), got.Msg.Team.GetLimits().GetRpmLimit(), "binary mask %s", path)
	}
	code, out := b.callJSON(b.bootstrap, "/sluice.admin.v1.TeamService/UpdateTeam",
		`{"team":{"id":"`+fx.team1.TeamID+`"},"update_mask":"limits.rpm_limitt"}`)
	require.Equal(t, "invalid_argument", code, "%s", out)
	require.Contains(t, string(out), "rpm_limitt")
}

// TestOrgLimitsArePlatformOnly: an org admin updates its org's metadata
// but not its limits or budget; a platform token does.
func TestOrgLimitsArePlatformOnly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fx := b.mkFixture("orglimits")
	orgAdmin := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, fx.team1.OrgID, "")
	before := b.auditCount()
	for _, mask := range []string{"limits", "limits.rpm_limit", "limits.maxBudget,limits.budgetDuration", "metadata,limits"} {
		code, out := b.callJSON(orgAdmin, "/sluice.admin.v1.OrgService/UpdateOrg",
			`{"org":{"id":"`+fx.team1.OrgID+`","limits":{"rpm_limit":1000000,"max_budget":1e6,"budget_duration":"30d"}},"update_mask":"`+mask+`"}`)
		require.Equal(t, "permission_denied", code, "org admin mask %s: %s", mask, out)
	}
	require.Equal(t, before, b.auditCount())
	code, out := b.callJSON(orgAdmin, "/sluice.admin.v1.OrgService/UpdateOrg",
		`{"org":{"id":"`+fx.team1.OrgID+`","metadata":{"owner":"x"}},"update_mask":"metadata"}`)
	require.Equal(t, "ok", code, "org admin metadata: %s", out)
	code, out = b.callJSON(b.bootstrap, "/sluice.admin.v1.OrgService/UpdateOrg",
		`{"org":{"id":"`+fx.team1.OrgID+`","limits":{"rpm_limit":1000}},"update_mask":"limits.rpm_limit"}`)
	require.Equal(t, "ok", code, "platform limits: %s", out)
}
