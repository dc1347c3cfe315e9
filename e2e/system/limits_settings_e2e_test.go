package system

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/internal/budget"
	"github.com/sluicegw/sluice/internal/token"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// settingsUpstream answers chat completions with fixed usage (10 prompt,
// 5 completion tokens). A body with "hold_ms" streams for that long.
func settingsUpstream(t *testing.T) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Stream bool  `json:"stream"`
			HoldMS int64 `json:"hold_ms"`
		}
		b, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(b, &body)
		if !body.Stream {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-time.After(time.Duration(body.HoldMS) * time.Millisecond):
		case <-r.Context().Done():
			return
		}
		fmt.Fprint(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":5,\"total_tokens\":15}}\n\ndata: [DONE]\n\n")
	}))
	t.Cleanup(srv.Close)
	return srv.URL + "/v1"
}

// limitLevels are the admin API messages that carry Limits, and the extra
// limit fields of each besides "limits" (found by name: max_*, *budget*,
// *limit*, *concurrency*).
func limitLevels(t *testing.T) map[string][]string {
	t.Helper()
	fd, err := protoregistry.GlobalFiles.FindDescriptorByName("sluice.admin.v1.Limits")
	require.NoError(t, err)
	limitsDesc := fd.(protoreflect.MessageDescriptor)
	out := map[string][]string{}
	protoregistry.GlobalFiles.RangeFilesByPackage("sluice.admin.v1", func(f protoreflect.FileDescriptor) bool {
		msgs := f.Messages()
		for i := 0; i < msgs.Len(); i++ {
			m := msgs.Get(i)
			name := string(m.Name())
			if strings.HasSuffix(name, "Request") || strings.HasSuffix(name, "Response") || m.FullName() == limitsDesc.FullName() {
				continue
			}
			var extra []string
			hasLimits := false
			fields := m.Fields()
			for j := 0; j < fields.Len(); j++ {
				fl := fields.Get(j)
				fn := string(fl.Name())
				if fl.Message() != nil && fl.Message().FullName() == limitsDesc.FullName() {
					hasLimits = true
					continue
				}
				if strings.HasPrefix(fn, "max_") || strings.Contains(fn, "budget") || strings.Contains(fn, "limit") || strings.Contains(fn, "concurrency") ||
					strings.Contains(fn, "prefill") {
					extra = append(extra, fn)
				}
			}
			if hasLimits || len(extra) > 0 {
				out[name] = extra
			}
		}
		return true
	})
	return out
}

// TestNoDeadLimitSettings enumerates every limit field of every level from
// the admin API schema (sluice.admin.v1) and proves, through the admin API
// and a real data plane, that each one is enforced on the request path:
// it rejects when exceeded (429 naming the scope and the limit, 403 for
// allowed_models, 503 overloaded for a deployment's max_concurrency), or,
// for the soft budget, fires its alert. A field the admin API accepts at
// a level where it is not enforced must be refused by the admin API with
// InvalidArgument. A limit field added to the schema later without a case
// here fails this test.
func TestNoDeadLimitSettings(t *testing.T) {
	d := startDist(t)
	ctx := context.Background()
	up := settingsUpstream(t)
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "m", PlatformWide: true}))
	require.NoError(t, err)
	_, err = m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "other", PlatformWide: true}))
	require.NoError(t, err)
	// $0.5 per prompt token, $1 per completion token: $10 a request.
	prices := &adminv1.Prices{InputPerToken: 0.5, OutputPerToken: 1}
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "m", ApiBase: up,
		UpstreamModel: "up", Weight: 1, Prices: prices}))
	require.NoError(t, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "other", ApiBase: up,
		UpstreamModel: "up", Weight: 1, Prices: prices}))
	require.NoError(t, err)
	p := d.StartProxy("default", time.Minute)
	// A data plane whose Redis is unreachable (rate_limit_fallback).
	pDead := d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.RedisURL = "redis://" + closedPort(t) + "/0" })
	c := d.Clients()
	cc := d.customerClient()
	peppers, err := token.ParsePeppers(testPepper)
	require.NoError(t, err)

	// Levels and fields from the schema. Every level must be known here.
	levels := limitLevels(t)
	knownLevels := map[string][]string{
		"Org": nil, "Team": nil, "User": nil, "Customer": nil, "Key": nil,
		// Project and tag scopes (one message, two kinds: the levels
		// "Project" and "Tag" below).
		"LabelScope": nil,
		"TeamMember": {"max_budget_in_team"},
		"Deployment": {"max_concurrency"},
		// Capability filters of a deployment (issue 4): 400 naming the
		// parameter when no deployment can take the request.
		"Capabilities": {"max_input_tokens", "max_output_tokens"},
		// Traffic settings (issue 12): demotion thresholds, the batch cap
		// and the queue length are enforced and tested with the gateway
		// (dataplane/internal/gateway/traffic_test.go: TestClassification,
		// TestReservedSlotsFleetWide, TestAdmissionQueue);
		// the prefill cap max_prefill_tokens_in_flight in
		// dataplane/internal/gateway/prefill_test.go (TestPrefillCapQueues).
		"Demotion":          {"max_prompt_tokens", "max_interactive_in_flight_per_key"},
		"DeploymentTraffic": {"batch_max_concurrency", "max_prefill_tokens_in_flight"},
		"ClassQueue":        {"max_length"},
		// Prefill isolation of a model group (issues 12/13): enforced and
		// tested with the gateway (dataplane/internal/gateway/prefill_test.go:
		// TestPrefillIsolation; the gate script in
		// dataplane/internal/limits/gate_test.go), refused at or above the
		// group's number of deployments (controlplane/internal/admin:
		// TestModelGroupPrefillIsolation).
		"ModelGroupTraffic": {"prefill_isolation"},
		// Resilience settings of a model group (issue 14): the attempt
		// budget across retries and fallbacks is enforced and tested with
		// the gateway (dataplane/internal/gateway/fallback_test.go:
		// TestFallbackSharesAttemptBudget).
		"ModelGroupResilience": {"max_attempts"},
	}
	// Read-only reports that merely name budgets (never accepted as input).
	reports := map[string]bool{"Alert": true}
	for lvl, extra := range levels {
		if reports[lvl] {
			continue
		}
		want, ok := knownLevels[lvl]
		require.True(t, ok, "admin message %s carries limit fields %v (or Limits) but this test has no case for it", lvl, extra)
		require.ElementsMatch(t, want, extra, "limit fields of %s", lvl)
	}
	for lvl := range knownLevels {
		require.Contains(t, levels, lvl, "level %s disappeared from the schema", lvl)
	}
	ld := (&adminv1.Limits{}).ProtoReflect().Descriptor().Fields()
	var limitFields []string
	for i := 0; i < ld.Len(); i++ {
		limitFields = append(limitFields, string(ld.Get(i).Name()))
	}
	// Every adminv1.Limits field has a data-plane counterpart of the same
	// name and kind (the control plane converts by name).
	cd := (&configv1.Limits{}).ProtoReflect().Descriptor().Fields()
	for i := 0; i < ld.Len(); i++ {
		f := cd.ByName(ld.Get(i).Name())
		require.NotNil(t, f, "configv1.Limits lacks %s: the data plane would never see it", ld.Get(i).Name())
		require.Equal(t, ld.Get(i).Kind(), f.Kind(), "kind of %s", f.Name())
	}

	// budget_duration is the window of the budget fields: every budget case
	// sets it to "2h" and checks the rejection's Retry-After against that
	// window's end.
	type fieldCase struct {
		limits   func() *adminv1.Limits
		perModel bool   // keys and teams only
		noMember bool   // refused on team members
		noLabel  bool   // refused on project and tag scopes
		check    string // "rpm", "tpm", "parallel", "budget", "soft", "allowed"
	}
	i64 := func(v int64) *int64 { return &v }
	f64 := func(v float64) *float64 { return &v }
	cases := map[string]fieldCase{
		"max_budget":            {limits: func() *adminv1.Limits { return &adminv1.Limits{MaxBudget: f64(5), BudgetDuration: "2h"} }, noMember: true, check: "budget"},
		"budget_duration":       {limits: func() *adminv1.Limits { return &adminv1.Limits{SoftBudget: f64(1), BudgetDuration: "2h"} }, check: "soft"},
		"soft_budget":           {limits: func() *adminv1.Limits { return &adminv1.Limits{SoftBudget: f64(1), BudgetDuration: "2h"} }, check: "soft"},
		"rpm_limit":             {limits: func() *adminv1.Limits { return &adminv1.Limits{RpmLimit: i64(1)} }, check: "rpm"},
		"tpm_limit":             {limits: func() *adminv1.Limits { return &adminv1.Limits{TpmLimit: i64(200)} }, check: "tpm"},
		"max_parallel_requests": {limits: func() *adminv1.Limits { return &adminv1.Limits{MaxParallelRequests: i64(1)} }, check: "parallel"},
		"allowed_models": {limits: func() *adminv1.Limits { return &adminv1.Limits{AllowedModels: []string{"other"}} }, noMember: true, noLabel: true,
			check: "allowed"},
		"model_max_budget": {limits: func() *adminv1.Limits {
			return &adminv1.Limits{ModelMaxBudget: map[string]float64{"m": 5}, BudgetDuration: "2h"}
		}, perModel: true, check: "budget"},
		"model_rpm_limit": {limits: func() *adminv1.Limits { return &adminv1.Limits{ModelRpmLimit: map[string]int64{"m": 1}} }, perModel: true, check: "rpm"},
		"model_tpm_limit": {limits: func() *adminv1.Limits { return &adminv1.Limits{ModelTpmLimit: map[string]int64{"m": 200}} }, perModel: true, check: "tpm"},
		// Proved on a data plane whose Redis is unreachable and whose
		// default is closed: the level's "local" admits by the local share.
		"rate_limit_fallback": {limits: func() *adminv1.Limits {
			return &adminv1.Limits{RpmLimit: i64(1000), RateLimitFallback: "local"}
		}, check: "fallback"},
	}
	for _, f := range limitFields {
		_, ok := cases[f]
		require.True(t, ok, "Limits.%s has no enforcement case: add one (and enforce it) or the setting is dead", f)
	}

	n := 0
	lc := d.labelScopeClient()
	for _, lvl := range []string{"Key", "Team", "User", "TeamMember", "Org", "Customer", "Project", "Tag"} {
		for _, field := range limitFields {
			fc := cases[field]
			n++
			name := fmt.Sprintf("%s/%s", lvl, field)
			t.Run(name, func(t *testing.T) {
				ten := d.NewTenant(fmt.Sprintf("s%d", n))
				custExt := ""
				label := lvl == "Project" || lvl == "Tag"
				refused := (fc.perModel && lvl != "Key" && lvl != "Team") || (fc.noMember && lvl == "TeamMember") || (fc.noLabel && label)
				l := fc.limits()
				var err error
				switch lvl {
				case "Key":
					_, err = c.Key.UpdateKey(ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{Key: &adminv1.Key{Id: ten.KeyID, Limits: l},
						UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits"}}}))
				case "Team":
					_, err = c.Team.UpdateTeam(ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{Team: &adminv1.Team{Id: ten.TeamID, Limits: l},
						UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits"}}}))
				case "User":
					_, err = c.User.UpdateUser(ctx, connect.NewRequest(&adminv1.UpdateUserRequest{User: &adminv1.User{Id: ten.UserID, Limits: l},
						UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits"}}}))
				case "TeamMember":
					_, err = c.Team.UpdateTeamMember(ctx, connect.NewRequest(&adminv1.UpdateTeamMemberRequest{
						Member:     &adminv1.TeamMember{TeamId: ten.TeamID, UserId: ten.UserID, Limits: l},
						UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits"}}}))
				case "Org":
					_, err = c.Org.UpdateOrg(ctx, connect.NewRequest(&adminv1.UpdateOrgRequest{Org: &adminv1.Org{Id: ten.OrgID, Limits: l},
						UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits"}}}))
				case "Customer":
					custExt = "cust-" + strconv.Itoa(n)
					_, err = cc.CreateCustomer(ctx, connect.NewRequest(&adminv1.CreateCustomerRequest{OrgId: ten.OrgID, ExternalId: custExt, Limits: l}))
				case "Project", "Tag":
					// The tenant's key carries the label; the scope limits it.
					name, kind := "label-"+strconv.Itoa(n), adminv1.LabelScopeKind_LABEL_SCOPE_KIND_PROJECT
					k := &adminv1.Key{Id: ten.KeyID, Project: name}
					mask := "project"
					if lvl == "Tag" {
						kind, k, mask = adminv1.LabelScopeKind_LABEL_SCOPE_KIND_TAG, &adminv1.Key{Id: ten.KeyID, Tags: []string{"plain", name}}, "tags"
					}
					_, err = c.Key.UpdateKey(ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{Key: k, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{mask}}}))
					require.NoError(t, err)
					_, err = lc.CreateLabelScope(ctx, connect.NewRequest(&adminv1.CreateLabelScopeRequest{OrgId: ten.OrgID, Kind: kind, Name: name, Limits: l}))
				}
				if refused {
					require.Error(t, err, "%s must be refused on %s", field, lvl)
					require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
					require.Contains(t, err.Error(), field)
					return
				}
				require.NoError(t, err)
				waitLimits(t, p, peppers, ten.Token, lvl, ten.OrgID, custExt, l)
				if fc.check == "fallback" {
					waitLimits(t, pDead, peppers, ten.Token, lvl, ten.OrgID, custExt, l)
					checkFallback(t, pDead, ten, custExt, lvl, l)
					return
				}
				checkEnforced(t, p, ten, custExt, lvl, fc.check)
			})
		}
	}

	t.Run("TeamMember/max_budget_in_team", func(t *testing.T) {
		ten := d.NewTenant("member-budget")
		_, err := c.Team.UpdateTeamMember(ctx, connect.NewRequest(&adminv1.UpdateTeamMemberRequest{
			Member:     &adminv1.TeamMember{TeamId: ten.TeamID, UserId: ten.UserID, MaxBudgetInTeam: f64(5), Limits: &adminv1.Limits{BudgetDuration: "2h"}},
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"max_budget_in_team", "limits"}}}))
		require.NoError(t, err)
		harness.Eventually(t, func() bool {
			pr, err := p.DP.Catalog().Authenticate(peppers, ten.Token, time.Now())
			return err == nil && pr.Member != nil && pr.Member.GetMaxBudgetInTeam() == 5
		}, 10*time.Second, 10*time.Millisecond)
		checkEnforced(t, p, ten, "", "TeamMember", "budget")
	})

	t.Run("Deployment/max_concurrency", func(t *testing.T) {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "capped", PlatformWide: true}))
		require.NoError(t, err)
		dep, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "capped", ApiBase: up,
			UpstreamModel: "up", Weight: 1, Prices: prices, MaxConcurrency: 1}))
		require.NoError(t, err)
		// A second instance (the cap is fleet-wide) whose interactive queue
		// gives up after 2 s: the default 30 s equals the hold's length, and
		// whichever ends first would decide the answer.
		p2 := d.StartProxy("default", time.Minute, func(c *dataplane.Config) {
			c.AdmissionQueues = "interactive=256/2s,agent=1024/1m0s,batch=1024/2m0s"
		})
		for _, px := range []*proxy{p, p2} {
			harness.Eventually(t, func() bool { return len(px.DP.Catalog().Deployments("capped")) == 1 }, 10*time.Second, 10*time.Millisecond)
		}
		ten := d.NewTenant("dep-cap")
		harness.WaitStatus(t, p2, ten.Token, http.StatusOK, 10*time.Second)
		// The deployment serves (its epoch was bootstrapped when its
		// creation event arrived; a Redis call that timed out on a loaded
		// machine would leave it in quarantine for 2 s); then every
		// settlement, which releases the deployment lease just after the
		// answer, is applied.
		body := `{"model":"capped","messages":[{"role":"user","content":"hi"}],"max_tokens":5}`
		var warm openAIError
		ok := harness.Until(func() bool { warm = settingsPost(t, p, ten.Token, "", body); return warm.status == http.StatusOK }, 10*time.Second, 20*time.Millisecond)
		require.True(t, ok, "capped deployment answers %d %s", warm.status, warm.Error.Code)
		for _, px := range []*proxy{p, p2} {
			dctx, dcancel := context.WithTimeout(ctx, 5*time.Second)
			require.NoError(t, px.DP.Drain(dctx))
			dcancel()
		}
		hold := startHold(t, p, ten.Token, "", "capped")
		defer hold()
		e := settingsPost(t, p2, ten.Token, "", `{"model":"capped","messages":[{"role":"user","content":"hi"}],"max_tokens":5}`)
		require.Equal(t, http.StatusServiceUnavailable, e.status, "deployment %s at max_concurrency 1", dep.Msg.Deployment.Id)
		require.Equal(t, dataplane.CodeOverloaded, e.Error.Code)
	})
	t.Run("Capabilities/max_input_tokens+max_output_tokens", func(t *testing.T) {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "small", PlatformWide: true}))
		require.NoError(t, err)
		_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "small", ApiBase: up,
			UpstreamModel: "up", Weight: 1, Prices: prices, Capabilities: &adminv1.Capabilities{MaxInputTokens: 50, MaxOutputTokens: 10}}))
		require.NoError(t, err)
		harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("small")) == 1 }, 10*time.Second, 10*time.Millisecond)
		ten := d.NewTenant("caps")
		harness.WaitStatus(t, p, ten.Token, http.StatusOK, 10*time.Second)
		e := settingsPost(t, p, ten.Token, "", `{"model":"small","messages":[{"role":"user","content":"hi"}],"max_tokens":100}`)
		require.Equal(t, http.StatusBadRequest, e.status)
		require.Equal(t, "max_tokens", *e.Error.Param)
		long := strings.Repeat("word ", 400)
		e = settingsPost(t, p, ten.Token, "", `{"model":"small","messages":[{"role":"user","content":"`+long+`"}],"max_tokens":5}`)
		require.Equal(t, http.StatusBadRequest, e.status)
		require.Equal(t, "messages", *e.Error.Param)
		require.Equal(t, 200, settingsPost(t, p, ten.Token, "", `{"model":"small","messages":[{"role":"user","content":"hi"}],"max_tokens":5}`).status)
	})
	t.Logf("checked %d level × field cases plus member and deployment fields", n)
}

// waitLimits waits until p's catalog holds limits l at level lvl.
func waitLimits(t *testing.T, p *proxy, peppers *token.Peppers, tok, lvl, org, custExt string, l *adminv1.Limits) {
	t.Helper()
	b, err := protojson.Marshal(l)
	require.NoError(t, err)
	want := &configv1.Limits{}
	require.NoError(t, protojson.Unmarshal(b, want))
	harness.Eventually(t, func() bool {
		cat := p.DP.Catalog()
		pr, err := cat.Authenticate(peppers, tok, time.Now())
		if err != nil {
			return false
		}
		var got *configv1.Limits
		switch lvl {
		case "Key":
			got = pr.Key.GetLimits()
		case "Team":
			got = pr.Team.GetLimits()
		case "User":
			got = pr.User.GetLimits()
		case "TeamMember":
			got = pr.Member.GetLimits()
		case "Org":
			got = pr.Org.GetLimits()
		case "Customer":
			got = cat.Customer(org, custExt).GetLimits()
		case "Project", "Tag":
			ls := cat.LabelScopes(pr.Key)
			if len(ls) != 1 {
				return false
			}
			got = ls[0].GetLimits()
		}
		return cmp.Diff(want, got, protocmp.Transform()) == ""
	}, 10*time.Second, 10*time.Millisecond, "limits of %s never reached the data plane", lvl)
}

// scopeKinds maps a level to the scope kinds that may name it in a
// rejection (per-model fields name the per-model scope).
var scopeKinds = map[string][]string{
	"Key": {"key", "key_model"}, "Team": {"team", "team_model"}, "User": {"user"}, "TeamMember": {"member"},
	"Org": {"org"}, "Customer": {"customer"}, "Project": {"project"}, "Tag": {"tag"},
}

const settingsBody = `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5}`

// checkEnforced proves one limit of level lvl is enforced.
func checkEnforced(t *testing.T, p *proxy, ten tenant, custExt, lvl, check string) {
	t.Helper()
	expectRejected := func(e openAIError, limitType string) {
		t.Helper()
		require.Equal(t, http.StatusTooManyRequests, e.status, "%+v", e.Error)
		require.Equal(t, limitType, e.hdr.Get(dataplane.HeaderLimitType))
		kind, _, _ := strings.Cut(e.hdr.Get(dataplane.HeaderLimitScope), ":")
		require.Contains(t, scopeKinds[lvl], kind, "rejection scope %s", e.hdr.Get(dataplane.HeaderLimitScope))
	}
	switch check {
	case "rpm":
		require.Equal(t, 200, settingsPost(t, p, ten.Token, custExt, settingsBody).status)
		expectRejected(settingsPost(t, p, ten.Token, custExt, settingsBody), "rpm")
	case "tpm":
		e := settingsPost(t, p, ten.Token, custExt, `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1000}`)
		expectRejected(e, "tpm")
		require.Equal(t, 200, settingsPost(t, p, ten.Token, custExt, settingsBody).status, "a request within the tpm limit passes")
	case "parallel":
		stop := startHold(t, p, ten.Token, custExt, "m")
		expectRejected(settingsPost(t, p, ten.Token, custExt, settingsBody), "parallel")
		stop()
		harness.Eventually(t, func() bool { return settingsPost(t, p, ten.Token, custExt, settingsBody).status == 200 },
			5*time.Second, 20*time.Millisecond, "the slot comes back when the stream ends")
	case "budget":
		require.Equal(t, 200, settingsPost(t, p, ten.Token, custExt, settingsBody).status) // $10 ≥ $5 once settled
		var e openAIError
		harness.Eventually(t, func() bool {
			e = settingsPost(t, p, ten.Token, custExt, settingsBody)
			return e.status == http.StatusTooManyRequests
		}, 5*time.Second, 20*time.Millisecond)
		expectRejected(e, "budget")
		require.Equal(t, dataplane.CodeBudgetExceeded, e.Error.Code)
		require.Equal(t, "false", e.hdr.Get("X-Should-Retry"))
		_, end, err := catalogWindow("2h")
		require.NoError(t, err)
		secs, err := strconv.ParseFloat(e.hdr.Get("Retry-After"), 64)
		require.NoError(t, err)
		require.InDelta(t, time.Until(end).Seconds(), secs, 3, "retry-after runs to the end of the 2h window")
	case "soft":
		before := alertCount(t, p, scopeKinds[lvl][0])
		require.Equal(t, 200, settingsPost(t, p, ten.Token, custExt, settingsBody).status) // $10 ≥ soft $1
		harness.Eventually(t, func() bool { return alertCount(t, p, scopeKinds[lvl][0]) > before }, 5*time.Second, 20*time.Millisecond,
			"the soft budget of %s fires its alert", lvl)
		require.Equal(t, 200, settingsPost(t, p, ten.Token, custExt, settingsBody).status, "a soft budget never rejects")
	case "allowed":
		e := settingsPost(t, p, ten.Token, custExt, settingsBody)
		require.Equal(t, http.StatusForbidden, e.status)
		require.Equal(t, dataplane.CodeModelNotAllowed, e.Error.Code)
		require.Equal(t, 200, settingsPost(t, p, ten.Token, custExt, strings.Replace(settingsBody, `"m"`, `"other"`, 1)).status)
	default:
		t.Fatalf("unknown check %q", check)
	}
}

// checkFallback proves rate_limit_fallback on pDead (Redis unreachable,
// data-plane default closed): the level's "local" admits the request by
// the local share of its rpm limit (without it the request is refused
// 503 limits_unavailable, as TestLocalRateFallbackSharesTheLimit and the
// proxy tests show).
func checkFallback(t *testing.T, pDead *proxy, ten tenant, custExt, lvl string, l *adminv1.Limits) {
	t.Helper()
	require.Equal(t, "local", l.GetRateLimitFallback())
	e := settingsPost(t, pDead, ten.Token, custExt, settingsBody)
	require.Equal(t, 200, e.status, "%s allows the local fallback: %+v", lvl, e.Error)
}

func catalogWindow(w string) (time.Time, time.Time, error) {
	return budget.Window(w, time.Now())
}

// alertCount reads sluice_proxy_budget_alerts_total{scope_kind=kind} of p.
func alertCount(t *testing.T, p *proxy, kind string) float64 {
	t.Helper()
	mfs, err := p.DP.Gatherer().Gather()
	require.NoError(t, err)
	var n float64
	for _, mf := range mfs {
		if mf.GetName() != "sluice_proxy_budget_alerts_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "scope_kind" && l.GetValue() == kind {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n
}

func settingsPost(t *testing.T, p *proxy, tok, custExt, body string) openAIError {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+tok)
	if custExt != "" {
		req.Header.Set(dataplane.HeaderEndUser, custExt)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	out := openAIError{status: resp.StatusCode, id: resp.Header.Get(dataplane.RequestIDHeader), hdr: resp.Header}
	if resp.StatusCode != 200 {
		require.NoError(t, json.Unmarshal(b, &out), "%s", b)
	}
	return out
}

// startHold opens a stream that holds its slot until the returned func is
// called (which waits for the stream to end).
func startHold(t *testing.T, p *proxy, tok, custExt, model string) func() {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true,"hold_ms":30000}`
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+tok)
	if custExt != "" {
		req.Header.Set(dataplane.HeaderEndUser, custExt)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("hold request answered %d: %s", resp.StatusCode, b)
	}
	buf := make([]byte, 16)
	_, err = resp.Body.Read(buf) // the first chunk: the stream is live upstream
	require.NoError(t, err)
	return func() { cancel(); _ = resp.Body.Close() }
}
