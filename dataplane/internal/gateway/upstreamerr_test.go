package gateway

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// lockedBuffer is a log destination safe for concurrent writes.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestUpstreamErrorsAreTyped: an engine's 4xx comes back as a typed Sluice
// error in the OpenAI shape, never in the engine's shape: a request the
// engine refuses (vLLM simulator, FastAPI-shaped 422) is 400
// upstream_bad_request with the engine's message, sanitised; an
// engine refusing the deployment's credential (401/403) is 502
// upstream_auth_failed, logged for the operator without the credential; an
// engine that does not serve the deployment's model is 502 upstream_error.
func TestUpstreamErrorsAreTyped(t *testing.T) {
	t.Parallel()
	const (
		simKey    = "sim-right-credential-0123"
		wrongCred = "sim-wrong-credential-4567"
	)
	authSim := startSim(t, func(c *vllmsim.Config) { c.APIKey = simKey })
	openSim := startSim(t, nil)
	// A FastAPI-style engine: a 422 whose validation error echoes the input
	// (never relayed), a 400 whose message names the engine's own address
	// and the credential it was sent (both removed), a 403.
	var fakeURL string
	fake := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		switch {
		case strings.Contains(r.Header.Get("Authorization"), "forbidden"):
			w.WriteHeader(http.StatusForbidden)
			fmt.Fprint(w, `{"detail":"Forbidden"}`)
		case strings.Contains(r.Header.Get("Authorization"), "leaky"):
			w.WriteHeader(http.StatusBadRequest)
			fmt.Fprintf(w, `{"object":"error","message":"engine at %s got token %s and\nrefused: bad \u0007 stop","type":"BadRequestError","param":"stop","code":400}`,
				fakeURL, strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer "))
		default:
			w.WriteHeader(http.StatusUnprocessableEntity)
			fmt.Fprint(w, `{"detail":[{"type":"missing","loc":["body","messages",0,"role"],"msg":"Field required","input":{"content":"SECRET-PROMPT-TEXT"}}]}`)
		}
	}))
	t.Cleanup(fake.Close)
	fakeURL = fake.URL

	logs := &lockedBuffer{}
	e := newEnv(t, func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(logs, nil)) })
	e.open = func(ct []byte) ([]byte, error) { return ct, nil } // "sealed" = plain, for the test
	cred := func(c string) func(*configv1.Deployment) {
		return func(d *configv1.Deployment) { d.CredentialCiphertext = []byte(c) }
	}
	for _, g := range []string{"right", "nocred", "wrongcred", "open", "badmodel", "fastapi", "forbidden", "leaky"} {
		e.group(g)
	}
	e.deploy("d-right", "right", authSim.URL()+"/v1", cred(simKey))
	e.deploy("d-nocred", "nocred", authSim.URL()+"/v1", nil)
	e.deploy("d-wrong", "wrongcred", authSim.URL()+"/v1", cred(wrongCred))
	e.deploy("d-open", "open", openSim.URL()+"/v1", nil)
	e.deploy("d-badmodel", "badmodel", openSim.URL()+"/v1", func(d *configv1.Deployment) { d.UpstreamModel = "not-served" })
	e.deploy("d-fastapi", "fastapi", fake.URL+"/v1", nil)
	e.deploy("d-forbidden", "forbidden", fake.URL+"/v1", cred("forbidden-credential-89"))
	e.deploy("d-leaky", "leaky", fake.URL+"/v1", cred("leaky-credential-0000"))
	tok := e.key("k1", nil)
	e.apply()

	// The right credential is served: the mapping is about refusals only.
	resp := e.post(RouteChat, tok, chatBody("right", ""))
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)

	bad := `{"model":"%s","messages":[1,2],"max_tokens":4}`
	for _, tc := range []struct {
		name, body       string
		status           int
		typ, code, param string
		msgHas           []string
		msgLacks         []string
		noRetry          bool
	}{
		{"engine refuses messages [1,2]", fmt.Sprintf(bad, "open"), 400, openai.TypeInvalidRequest, openai.CodeUpstreamBadRequest, "",
			[]string{"the model server rejected the request: ", "invalid JSON body"}, nil, true},
		{"engine 400 on a stream", chatBody("open", `"stream":true,"min_tokens":50`), 400, openai.TypeInvalidRequest, openai.CodeUpstreamBadRequest, "",
			[]string{"min_tokens must be less than or equal to max_tokens=12"}, nil, true},
		{"FastAPI 422 becomes 400", chatBody("fastapi", ""), 400, openai.TypeInvalidRequest, openai.CodeUpstreamBadRequest, "messages.0.role",
			[]string{"messages.0.role: Field required"}, []string{"SECRET-PROMPT-TEXT"}, true},
		{"engine message sanitised", chatBody("leaky", ""), 400, openai.TypeInvalidRequest, openai.CodeUpstreamBadRequest, "stop",
			[]string{"[model server]", "[redacted]", "refused: bad"}, []string{fake.URL, strings.TrimPrefix(fake.URL, "http://"), "leaky-credential-0000", "\n", "\a"}, true},
		{"no credential", chatBody("nocred", ""), 502, openai.TypeUpstream, openai.CodeUpstreamAuthFailed, "",
			[]string{"HTTP 401", "your API key is not the problem"}, []string{"Unauthorized"}, false},
		{"wrong credential", chatBody("wrongcred", ""), 502, openai.TypeUpstream, openai.CodeUpstreamAuthFailed, "",
			[]string{"HTTP 401"}, []string{wrongCred}, false},
		{"wrong credential, stream", chatBody("wrongcred", `"stream":true`), 502, openai.TypeUpstream, openai.CodeUpstreamAuthFailed, "",
			[]string{"HTTP 401"}, nil, false},
		{"engine 403", chatBody("forbidden", ""), 502, openai.TypeUpstream, openai.CodeUpstreamAuthFailed, "",
			[]string{"HTTP 403"}, []string{"forbidden-credential-89"}, false},
		{"engine does not serve the model", chatBody("badmodel", ""), 502, openai.TypeUpstream, openai.CodeUpstreamError, "",
			[]string{"HTTP 404", "operator"}, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := readErr(t, e.post(RouteChat, tok, tc.body))
			require.Equal(t, tc.status, a.Status, "%+v", a.Error)
			require.Equal(t, "application/json", a.Header.Get("Content-Type"))
			require.Equal(t, tc.typ, a.Error.Type)
			require.Equal(t, tc.code, a.Error.Code)
			require.Equal(t, tc.param, deref(a.Error.Param))
			for _, s := range tc.msgHas {
				require.Contains(t, a.Error.Message, s)
			}
			for _, s := range tc.msgLacks {
				require.NotContains(t, a.Error.Message, s)
			}
			require.Equal(t, tc.noRetry, a.Header.Get("X-Should-Retry") == "false", "x-should-retry")
			ev := e.sink.byID(t, a.Header.Get(openai.RequestIDHeader))
			require.Equal(t, int32(tc.status), ev.Status)
			require.Equal(t, tc.code, ev.ErrorCode)
			require.Zero(t, ev.PromptTokens+ev.CompletionTokens, "nothing generated, nothing charged")
		})
	}

	// The operator is told, without the credential.
	out := logs.String()
	require.Contains(t, out, "the upstream refused the deployment's credential")
	for _, d := range []string{"d-nocred", "d-wrong", "d-forbidden"} {
		require.Contains(t, out, "deployment="+d)
	}
	require.Contains(t, out, "the upstream does not serve the deployment's model or route")
	for _, secret := range []string{simKey, wrongCred, "forbidden-credential-89", "leaky-credential-0000", "SECRET-PROMPT-TEXT"} {
		require.NotContains(t, out, secret)
	}
	require.Equal(t, 2.0, counter(t, e.reg, "sluice_proxy_upstream_errors_total", map[string]string{"deployment": "d-wrong", "kind": "auth"}))
	require.Equal(t, 1.0, counter(t, e.reg, "sluice_proxy_upstream_errors_total", map[string]string{"deployment": "d-forbidden", "kind": "auth"}))
	require.Equal(t, 1.0, counter(t, e.reg, "sluice_proxy_upstream_errors_total", map[string]string{"deployment": "d-badmodel", "kind": "not_found"}))
}
