package gateway

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	"github.com/sluicegw/sluice/internal/token"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

const testPepper = "1:proxy-test-pepper-0123456789abcdefghijklmn"

// recSink records usage events.
type recSink struct {
	mu  sync.Mutex
	evs []*usagev1.UsageEvent
}

func (s *recSink) Record(ev *usagev1.UsageEvent) {
	s.mu.Lock()
	s.evs = append(s.evs, ev)
	s.mu.Unlock()
}

func (s *recSink) events() []*usagev1.UsageEvent {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*usagev1.UsageEvent(nil), s.evs...)
}

// byID returns the event of a request id (failing if there is not
// exactly one). The event is recorded when the exchange finishes, which
// may be just after the client read the whole answer: it waits up to 5 s.
func (s *recSink) byID(t testing.TB, id string) *usagev1.UsageEvent {
	t.Helper()
	var out *usagev1.UsageEvent
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		for _, ev := range s.events() {
			if ev.RequestId == id {
				require.Nil(t, out, "two usage events for %s", id)
				out = ev
			}
		}
		if out != nil || time.Now().After(deadline) {
			break
		}
	}
	require.NotNil(t, out, "no usage event for %s", id)
	return out
}

// env is a proxy over an in-memory catalog.
type env struct {
	t       testing.TB
	peppers *token.Peppers
	snap    *configv1.Snapshot
	cat     atomic.Pointer[catalog.Catalog]
	sink    *recSink
	reg     *prometheus.Registry
	h       *Handler
	srv     *httptest.Server
	gate    atomic.Pointer[oai.Error]
	open    catalog.OpenFunc
}

type envOpt func(*Config)

// withProbation turns the stream probation on (the proxy's default): the
// test env runs it off so that the tests of what happens once a stream's
// bytes are out (cuts, disconnects, deadlines, leases of a live stream)
// see them at once; probation_test.go tests it.
func withProbation(c *Config) { c.NoStreamProbation = false }

// newEnv starts a proxy with one org (o1), team (t1), user (u1) and no
// keys or models; add them with key, group and deploy, then call apply.
// The stream probation is off (withProbation turns it on).
func newEnv(t testing.TB, opts ...envOpt) *env {
	t.Helper()
	p, err := token.ParsePeppers(testPepper)
	require.NoError(t, err)
	e := &env{t: t, peppers: p, sink: &recSink{}, reg: prometheus.NewRegistry(),
		snap: &configv1.Snapshot{Version: 1,
			Orgs:    []*configv1.Org{{Id: "o1"}},
			Teams:   []*configv1.Team{{Id: "t1", OrgId: "o1"}},
			Users:   []*configv1.User{{Id: "u1", OrgId: "o1"}},
			Members: []*configv1.Member{{TeamId: "t1", UserId: "u1", OrgId: "o1"}},
		}}
	cfg := Config{Catalog: e.cat.Load, Peppers: p, Usage: e.sink, Registerer: e.reg, Region: "test", InstanceID: "i1",
		Gate: func() *oai.Error { return e.gate.Load() }, Logger: slog.New(slog.DiscardHandler), NoStreamProbation: true}
	for _, o := range opts {
		o(&cfg)
	}
	e.h, err = New(cfg)
	require.NoError(t, err)
	mux := http.NewServeMux()
	e.h.Register(mux)
	e.srv = httptest.NewServer(mux)
	t.Cleanup(e.srv.Close)
	// The settlement worker runs as a component, as in a data plane.
	ctx, cancel := context.WithCancel(context.Background())
	settlerDone := make(chan struct{})
	go func() { defer close(settlerDone); _ = e.h.RunSettler(ctx) }()
	t.Cleanup(func() { cancel(); <-settlerDone })
	e.apply()
	return e
}

// key adds a key (edit customises it) and returns its token.
func (e *env) key(id string, edit func(*configv1.Key)) string {
	tok := token.Generate(token.KeyPrefix)
	hash, v := e.peppers.HashCurrent(tok)
	k := &configv1.Key{Id: id, OrgId: "o1", TeamId: "t1", UserId: "u1", Hash: hash, PepperVersion: int32(v)}
	if edit != nil {
		edit(k)
	}
	e.snap.Keys = append(e.snap.Keys, k)
	return tok
}

func (e *env) group(name string) {
	e.snap.ModelGroups = append(e.snap.ModelGroups, &configv1.ModelGroup{Name: name, PlatformWide: true})
}

// deploy adds a deployment of group at apiBase with test prices.
func (e *env) deploy(id, group, apiBase string, edit func(*configv1.Deployment)) *configv1.Deployment {
	d := &configv1.Deployment{Id: id, ModelGroup: group, ApiBase: apiBase, UpstreamModel: vllmsim.DefaultModel, Weight: 1,
		Prices: &configv1.Prices{InputPerToken: 1e-6, OutputPerToken: 2e-6}}
	if edit != nil {
		edit(d)
	}
	e.snap.Deployments = append(e.snap.Deployments, d)
	return d
}

// apply rebuilds the catalog from the snapshot.
func (e *env) apply() {
	e.t.Helper()
	c, err := catalog.FromSnapshot(proto.Clone(e.snap).(*configv1.Snapshot), 0, e.open)
	require.NoError(e.t, err)
	e.cat.Store(c)
}

// sim starts a vLLM simulator (fast time, short default answers).
func startSim(t testing.TB, edit func(*vllmsim.Config)) *vllmsim.Server {
	t.Helper()
	cfg := vllmsim.DefaultConfig()
	cfg.Addr = "127.0.0.1:0"
	cfg.TimeScale = 20
	cfg.MeanOutputTokens = 16
	if edit != nil {
		edit(&cfg)
	}
	s, err := vllmsim.Start(cfg, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// post sends a JSON body with a bearer token.
func (e *env) post(route, tok, body string, hdr ...string) *http.Response {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodPost, e.srv.URL+route, strings.NewReader(body))
	require.NoError(e.t, err)
	req.Header.Set("Content-Type", "application/json")
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(e.t, err)
	return resp
}

// apiErr is a decoded OpenAI error answer.
type apiErr struct {
	Status int
	Header http.Header
	Error  struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    string  `json:"code"`
	} `json:"error"`
}

func readErr(t testing.TB, resp *http.Response) apiErr {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	var out apiErr
	require.NoError(t, json.Unmarshal(b, &out), "body %s", b)
	out.Status, out.Header = resp.StatusCode, resp.Header
	return out
}

// sseData returns the data payloads of an SSE body.
func sseData(t testing.TB, body io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			out = append(out, v)
		}
	}
	require.NoError(t, sc.Err())
	return out
}

func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func chatBody(model string, extra string) string {
	var b bytes.Buffer
	b.WriteString(`{"model":"` + model + `","messages":[{"role":"user","content":"Say hello to the test suite."}],"max_tokens":12`)
	if extra != "" {
		b.WriteString("," + extra)
	}
	b.WriteString("}")
	return b.String()
}

var past = timestamppb.New(time.Now().Add(-time.Hour))
