package gateway

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	"github.com/sluicegw/sluice/internal/token"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TestErrorMatrix: every rejection and upstream failure answers in the
// OpenAI shape with its documented status, type and code (docs/errors.md),
// carries a request id, and is accounted exactly once.
func TestErrorMatrix(t *testing.T) {
	t.Parallel()
	ok := startSim(t, nil)
	refused := startSim(t, nil)
	require.NoError(t, refused.SetRefuseConnections(true))
	fail500 := startSim(t, func(c *vllmsim.Config) { c.Faults.Status = 500 })
	fail503 := startSim(t, func(c *vllmsim.Config) { c.Faults.Status = 503 })

	e := newEnv(t, func(c *Config) { c.MaxBodyBytes = 2048 })
	e.open = func([]byte) ([]byte, error) { return nil, errors.New("no key version 9 in the key ring") }
	e.snap.Orgs = append(e.snap.Orgs, &configv1.Org{Id: "o-blk", Blocked: true},
		&configv1.Org{Id: "o-lim", Limits: &configv1.Limits{AllowedModels: []string{"other"}}})
	e.snap.Teams = append(e.snap.Teams, &configv1.Team{Id: "t-blk", OrgId: "o1", Blocked: true},
		&configv1.Team{Id: "t-lim", OrgId: "o1", Limits: &configv1.Limits{AllowedModels: []string{"other"}}})
	e.snap.Users = append(e.snap.Users, &configv1.User{Id: "u-blk", OrgId: "o1", Blocked: true},
		&configv1.User{Id: "u-lim", OrgId: "o1", Limits: &configv1.Limits{AllowedModels: []string{"other"}}})
	good := e.key("k-good", nil)
	expired := e.key("k-exp", func(k *configv1.Key) { k.ExpireTime = past })
	keyBlk := e.key("k-blk", func(k *configv1.Key) { k.Blocked = true })
	userBlk := e.key("k-ublk", func(k *configv1.Key) { k.TeamId, k.UserId = "", "u-blk" })
	teamBlk := e.key("k-tblk", func(k *configv1.Key) { k.TeamId, k.UserId = "t-blk", "" })
	orgBlk := e.key("k-oblk", func(k *configv1.Key) { k.OrgId, k.TeamId, k.UserId = "o-blk", "", "" })
	keyLim := e.key("k-klim", func(k *configv1.Key) { k.Limits = &configv1.Limits{AllowedModels: []string{"other"}} })
	teamLim := e.key("k-tlim", func(k *configv1.Key) { k.TeamId, k.UserId = "t-lim", "" })
	userLim := e.key("k-ulim", func(k *configv1.Key) { k.TeamId, k.UserId = "", "u-lim" })
	orgLim := e.key("k-olim", func(k *configv1.Key) { k.OrgId, k.TeamId, k.UserId = "o-lim", "", "" })
	byUpstream := e.key("k-up", func(k *configv1.Key) {
		k.Limits = &configv1.Limits{AllowedModels: []string{vllmsim.DefaultModel}}
	})
	embedOnly := e.key("k-routes", func(k *configv1.Key) { k.AllowedRoutes = []string{RouteEmbeddings} })
	enforced := e.key("k-enf", func(k *configv1.Key) { k.EnforcedParams = []string{"user", "metadata.trace"} })
	for _, g := range []string{"g", "other", "refused", "fail500", "fail503", "brokencred", "capped"} {
		e.group(g)
	}
	e.deploy("d-g", "g", ok.URL()+"/v1", nil)
	e.deploy("d-other", "other", ok.URL()+"/v1", nil)
	e.deploy("d-refused", "refused", refused.URL()+"/v1", nil)
	e.deploy("d-500", "fail500", fail500.URL()+"/v1", nil)
	e.deploy("d-503", "fail503", fail503.URL()+"/v1", nil)
	e.deploy("d-cred", "brokencred", ok.URL()+"/v1", func(d *configv1.Deployment) { d.CredentialCiphertext = []byte("v9:sealed") })
	e.deploy("d-capped", "capped", ok.URL()+"/v1", func(d *configv1.Deployment) {
		d.Capabilities = &configv1.Capabilities{MaxOutputTokens: 100, MaxInputTokens: 50}
	})
	e.apply()

	unknown := token.Generate(token.KeyPrefix) // well formed, never issued
	mistyped := good[:len(good)-1] + "x"
	if mistyped == good {
		mistyped = good[:len(good)-1] + "y"
	}
	msg := `"messages":[{"role":"user","content":"hi"}]`
	for _, tc := range []struct {
		name, tok, route, body  string
		hdr                     []string
		status                  int
		typ, code, param        string
		wantRetryAfter, noRetry bool
	}{
		{"missing key", "", RouteChat, chatBody("g", ""), nil, 401, openai.TypeInvalidRequest, openai.CodeMissingAPIKey, "", false, true},
		{"unknown key", "sk-sluice-wrong", RouteChat, chatBody("g", ""), nil, 401, openai.TypeInvalidRequest, openai.CodeInvalidAPIKey, "", false, true},
		{"mistyped key", mistyped, RouteChat, chatBody("g", ""), nil, 401, openai.TypeInvalidRequest, openai.CodeInvalidAPIKey, "", false, true},
		{"unknown key with a valid checksum", unknown, RouteChat, chatBody("g", ""), nil, 401, openai.TypeInvalidRequest, openai.CodeInvalidAPIKey, "", false, true},
		{"expired key", expired, RouteChat, chatBody("g", ""), nil, 401, openai.TypeInvalidRequest, openai.CodeKeyExpired, "", false, true},
		{"key blocked", keyBlk, RouteChat, chatBody("g", ""), nil, 403, openai.TypePermission, "key_blocked", "", false, true},
		{"user blocked", userBlk, RouteChat, chatBody("g", ""), nil, 403, openai.TypePermission, "user_blocked", "", false, true},
		{"team blocked", teamBlk, RouteChat, chatBody("g", ""), nil, 403, openai.TypePermission, "team_blocked", "", false, true},
		{"org blocked", orgBlk, RouteChat, chatBody("g", ""), nil, 403, openai.TypePermission, "org_blocked", "", false, true},
		{"route not allowed", embedOnly, RouteChat, chatBody("g", ""), nil, 403, openai.TypePermission, openai.CodeRouteNotAllowed, "", false, true},
		{"model not allowed by key", keyLim, RouteChat, chatBody("g", ""), nil, 403, openai.TypePermission, openai.CodeModelNotAllowed, "model", false, true},
		{"model not allowed by team", teamLim, RouteChat, chatBody("g", ""), nil, 403, openai.TypePermission, openai.CodeModelNotAllowed, "model", false, true},
		{"model not allowed by user", userLim, RouteChat, chatBody("g", ""), nil, 403, openai.TypePermission, openai.CodeModelNotAllowed, "model", false, true},
		{"model not allowed by org", orgLim, RouteChat, chatBody("g", ""), nil, 403, openai.TypePermission, openai.CodeModelNotAllowed, "model", false, true},
		{"unknown model", good, RouteChat, chatBody("nope", ""), nil, 404, openai.TypeNotFound, openai.CodeModelNotFound, "model", false, true},
		{"malformed JSON", good, RouteChat, `{"model":"g",`, nil, 400, openai.TypeInvalidRequest, openai.CodeInvalidJSON, "", false, true},
		{"not an object", good, RouteChat, `["g"]`, nil, 400, openai.TypeInvalidRequest, openai.CodeInvalidJSON, "", false, true},
		{"duplicate member", good, RouteChat, `{"model":"other","model":"g",` + msg + `}`, nil, 400, openai.TypeInvalidRequest, openai.CodeInvalidJSON, "model", false, true},
		{"missing model", good, RouteChat, `{` + msg + `}`, nil, 400, openai.TypeInvalidRequest, openai.CodeMissingRequiredParam, "model", false, true},
		{"model not a string", good, RouteChat, `{"model":7,` + msg + `}`, nil, 400, openai.TypeInvalidRequest, openai.CodeInvalidParameter, "model", false, true},
		{"stream not a boolean", good, RouteChat, chatBody("g", `"stream":"yes"`), nil, 400, openai.TypeInvalidRequest, openai.CodeInvalidParameter, "stream", false, true},
		{"body too large", good, RouteChat, chatBody("g", `"pad":"`+strings.Repeat("x", 4096)+`"`), nil, 413, openai.TypeInvalidRequest, openai.CodeRequestTooLarge, "", false, true},
		{"enforced param missing", enforced, RouteChat, chatBody("g", `"user":"u"`), nil, 400, openai.TypeInvalidRequest, openai.CodeMissingRequiredParam, "metadata.trace", false, true},
		{"tools unsupported", good, RouteChat, chatBody("g", `"tools":[{"type":"function","function":{"name":"f"}}]`), nil, 400, openai.TypeInvalidRequest, openai.CodeUnsupportedParameter, "tools", false, true},
		{"json mode unsupported", good, RouteChat, chatBody("g", `"response_format":{"type":"json_object"}`), nil, 400, openai.TypeInvalidRequest, openai.CodeUnsupportedParameter, "response_format", false, true},
		{"images unsupported", good, RouteChat, `{"model":"g","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:,"}}]}]}`, nil, 400, openai.TypeInvalidRequest, openai.CodeUnsupportedParameter, "messages", false, true},
		{"max_tokens above max_output_tokens", good, RouteChat, `{"model":"capped",` + msg + `,"max_completion_tokens":500}`, nil, 400, openai.TypeInvalidRequest, openai.CodeUnsupportedParameter, "max_completion_tokens", false, true},
		{"prompt above max_input_tokens", good, RouteCompletions, `{"model":"capped","prompt":"` + strings.Repeat("word ", 60) + `"}`, nil, 400, openai.TypeInvalidRequest, openai.CodeUnsupportedParameter, "prompt", false, true},
		{"end user header too long", good, RouteChat, chatBody("g", ""), []string{openai.HeaderEndUser, strings.Repeat("c", 300)}, 400, openai.TypeInvalidRequest, openai.CodeInvalidHeader, openai.HeaderEndUser, false, true},
		{"credential cannot be decrypted", good, RouteChat, chatBody("brokencred", ""), nil, 503, openai.TypeServiceUnavailable, openai.CodeNoHealthyDeployment, "", true, false},
		{"upstream refused", good, RouteChat, chatBody("refused", ""), nil, 502, openai.TypeUpstream, openai.CodeUpstreamError, "", true, false},
		{"upstream 500", good, RouteChat, chatBody("fail500", ""), nil, 502, openai.TypeUpstream, openai.CodeUpstreamError, "", true, false},
		{"upstream 503", good, RouteChat, chatBody("fail503", ""), nil, 503, openai.TypeServiceUnavailable, openai.CodeUpstreamOverloaded, "", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			preauth := map[string]string{"route": tc.route, "code": tc.code}
			before := counter(t, e.reg, "sluice_proxy_preauth_refusals_total", preauth)
			a := readErr(t, e.post(tc.route, tc.tok, tc.body, tc.hdr...))
			require.Equal(t, tc.status, a.Status, "%+v", a.Error)
			require.Equal(t, tc.typ, a.Error.Type)
			require.Equal(t, tc.code, a.Error.Code)
			require.Equal(t, tc.param, deref(a.Error.Param))
			require.NotEmpty(t, a.Error.Message)
			require.Equal(t, tc.wantRetryAfter, a.Header.Get("Retry-After") != "", "Retry-After")
			require.Equal(t, tc.noRetry, a.Header.Get("X-Should-Retry") == "false", "x-should-retry")
			id := a.Header.Get(openai.RequestIDHeader)
			if tc.code == openai.CodeMissingAPIKey || tc.code == openai.CodeInvalidAPIKey {
				// No key identified: counted, never a usage event. The
				// counter moves where the event would have been recorded.
				waitFor(t, "the pre-auth refusal counted", func() bool {
					return counter(t, e.reg, "sluice_proxy_preauth_refusals_total", preauth) == before+1
				})
				for _, ev := range e.sink.events() {
					require.NotEqual(t, id, ev.RequestId, "a usage event for a request without a key")
				}
				return
			}
			ev := e.sink.byID(t, id)
			require.Equal(t, int32(tc.status), ev.Status)
			require.Equal(t, tc.code, ev.ErrorCode)
		})
	}

	t.Run("allowed through the upstream model", func(t *testing.T) {
		resp := e.post(RouteChat, byUpstream, chatBody("g", ""))
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	})
	t.Run("enforced params present", func(t *testing.T) {
		resp := e.post(RouteChat, enforced, chatBody("g", `"user":"u","metadata":{"trace":"t1"}`))
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	})
	t.Run("attribution by key on rejection", func(t *testing.T) {
		a := readErr(t, e.post(RouteChat, keyBlk, chatBody("g", "")))
		ev := e.sink.byID(t, a.Header.Get(openai.RequestIDHeader))
		require.Equal(t, "k-blk", ev.KeyId)
		require.Equal(t, "o1", ev.OrgId)
		require.Empty(t, ev.RequestedModel, "a refused key's body is never read")
	})
	t.Run("upstream 4xx is typed", func(t *testing.T) {
		// Message content vLLM cannot read is a vLLM 400 (a client's
		// priority, the earlier example, never reaches the engine now).
		a := readErr(t, e.post(RouteChat, good, `{"model":"g","messages":[{"role":"user","content":5}],"max_tokens":5}`))
		require.Equal(t, http.StatusBadRequest, a.Status)
		require.Equal(t, openai.TypeInvalidRequest, a.Error.Type)
		require.Equal(t, openai.CodeUpstreamBadRequest, a.Error.Code)
		require.Contains(t, a.Error.Message, "message content must be a string")
		ev := e.sink.byID(t, a.Header.Get(openai.RequestIDHeader))
		require.Equal(t, openai.CodeUpstreamBadRequest, ev.ErrorCode)
	})
	t.Run("not ready", func(t *testing.T) {
		e.gate.Store(openai.Unavailable("stale_config", "stale", 5e9))
		defer e.gate.Store(nil)
		preauth := map[string]string{"route": RouteChat, "code": "stale_config"}
		before := counter(t, e.reg, "sluice_proxy_preauth_refusals_total", preauth)
		a := readErr(t, e.post(RouteChat, good, chatBody("g", "")))
		require.Equal(t, 503, a.Status)
		require.Equal(t, "stale_config", a.Error.Code)
		require.Equal(t, "5", a.Header.Get("Retry-After"))
		waitFor(t, "the pre-auth refusal counted", func() bool {
			return counter(t, e.reg, "sluice_proxy_preauth_refusals_total", preauth) == before+1
		})
		for _, ev := range e.sink.events() {
			require.NotEqual(t, a.Header.Get(openai.RequestIDHeader), ev.RequestId, "a usage event for a request refused before authentication")
		}
	})
	t.Run("unknown route and wrong method", func(t *testing.T) {
		a := readErr(t, e.post("/v1/nope", good, "{}"))
		require.Equal(t, 404, a.Status)
		require.Equal(t, openai.CodeUnknownRoute, a.Error.Code)
		resp, err := http.Get(e.srv.URL + RouteChat)
		require.NoError(t, err)
		a = readErr(t, resp)
		require.Equal(t, 405, a.Status)
		require.Equal(t, openai.CodeMethodNotAllowed, a.Error.Code)
		require.NotEmpty(t, a.Header.Get(openai.RequestIDHeader))
	})
	t.Run("metrics", func(t *testing.T) {
		require.Positive(t, counter(t, e.reg, "sluice_proxy_deployment_credential_errors_total", map[string]string{"deployment": "d-cred"}))
		require.Positive(t, counter(t, e.reg, "sluice_proxy_upstream_errors_total", map[string]string{"deployment": "d-refused", "kind": "refused"}))
		require.Positive(t, counter(t, e.reg, "sluice_proxy_upstream_errors_total", map[string]string{"deployment": "d-500", "kind": "status_5xx"}))
		require.Positive(t, counter(t, e.reg, "sluice_proxy_requests_total", map[string]string{"route": RouteChat, "model_group": "", "status_class": "4xx"}))
	})
}

func deref(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}

// counter reads a counter with exactly these labels from reg.
func counter(t testing.TB, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for _, l := range m.GetLabel() {
				if labels[l.GetName()] != l.GetValue() {
					continue next
				}
			}
			return value(m)
		}
	}
	return 0
}

func value(m *dto.Metric) float64 {
	if c := m.GetCounter(); c != nil {
		return c.GetValue()
	}
	return m.GetGauge().GetValue()
}
