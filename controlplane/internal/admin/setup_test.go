package admin

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/keyring"
	"github.com/sluicegw/sluice/internal/testsvc"
	"github.com/sluicegw/sluice/internal/token"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// fakeClock is a clock the test moves by hand.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// syncBuffer is a goroutine-safe log sink.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// bundle is one test's control plane: a fresh database, the admin API on
// an httptest server, a hand-moved clock and the captured logs.
type bundle struct {
	t         *testing.T
	pool      *pgxpool.Pool
	dbURL     string
	store     *store.Store
	clock     *fakeClock
	peppers   *token.Peppers
	bootstrap string
	url       string
	logs      *syncBuffer
}

const testPepper = "1:test-pepper-0123456789abcdefghijklmnopqrstuvwxyz"

// testKEK is the key ring of test servers: base64 of the 32 bytes
// "admin-test-kek-0123456789abcdefg".
const testKEK = "1:YWRtaW4tdGVzdC1rZWstMDEyMzQ1Njc4OWFiY2RlZmc="

func setup(t *testing.T) *bundle {
	t.Helper()
	pool, url := testsvc.NewPool(t)
	return setupOn(t, pool, url)
}

// setupOn is setup on a given pool (url is the database's direct URL).
func setupOn(t *testing.T, pool *pgxpool.Pool, url string, opts ...func(*Options)) *bundle {
	t.Helper()
	clock := &fakeClock{now: time.Date(2026, 11, 1, 12, 0, 0, 0, time.UTC)}
	peppers, err := token.ParsePeppers(testPepper)
	require.NoError(t, err)
	logs := &syncBuffer{}
	ring, err := keyring.Parse(testKEK)
	require.NoError(t, err)
	st := store.New(pool, clock.Now)
	b := &bundle{t: t, pool: pool, dbURL: url, store: st, clock: clock, peppers: peppers,
		bootstrap: "bootstrap-admin-token-for-tests-0123456789", logs: logs}
	o := Options{Store: st, Peppers: peppers, BootstrapToken: b.bootstrap, KeyRing: ring,
		Logger: slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	for _, f := range opts {
		f(&o)
	}
	h := NewHandler(o)
	srv := httptest.NewUnstartedServer(h)
	srv.EnableHTTP2 = true
	srv.Start()
	t.Cleanup(srv.Close)
	b.url = srv.URL
	return b
}

// clients is a full set of admin clients for one token.
type clients struct {
	Org      adminv1connect.OrgServiceClient
	Team     adminv1connect.TeamServiceClient
	User     adminv1connect.UserServiceClient
	Key      adminv1connect.KeyServiceClient
	Customer adminv1connect.CustomerServiceClient
	// LabelScope manages project and tag scopes.
	LabelScope adminv1connect.LabelScopeServiceClient
	Issuer     adminv1connect.IssuerServiceClient
	Token      adminv1connect.AdminTokenServiceClient
	Audit      adminv1connect.AuditServiceClient
}

func bearer(tok string) connect.UnaryInterceptorFunc {
	return func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			req.Header().Set("Authorization", "Bearer "+tok)
			return next(ctx, req)
		}
	}
}

func (b *bundle) as(tok string) clients {
	opt := connect.WithInterceptors(bearer(tok))
	hc := http.DefaultClient
	return clients{
		Org:        adminv1connect.NewOrgServiceClient(hc, b.url, opt),
		Team:       adminv1connect.NewTeamServiceClient(hc, b.url, opt),
		User:       adminv1connect.NewUserServiceClient(hc, b.url, opt),
		Key:        adminv1connect.NewKeyServiceClient(hc, b.url, opt),
		Customer:   adminv1connect.NewCustomerServiceClient(hc, b.url, opt),
		LabelScope: adminv1connect.NewLabelScopeServiceClient(hc, b.url, opt),
		Issuer:     adminv1connect.NewIssuerServiceClient(hc, b.url, opt),
		Token:      adminv1connect.NewAdminTokenServiceClient(hc, b.url, opt),
		Audit:      adminv1connect.NewAuditServiceClient(hc, b.url, opt),
	}
}

// root returns clients with the bootstrap token.
func (b *bundle) root() clients { return b.as(b.bootstrap) }

// callJSON posts a Connect JSON request and returns the Connect code
// ("ok" on success) and the body.
func (b *bundle) callJSON(tok, procedure, body string) (string, []byte) {
	b.t.Helper()
	req, err := http.NewRequest(http.MethodPost, b.url+procedure, strings.NewReader(body))
	require.NoError(b.t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(b.t, err)
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	require.NoError(b.t, err)
	if resp.StatusCode == http.StatusOK {
		return "ok", out
	}
	var e struct {
		Code string `json:"code"`
	}
	_ = jsonUnmarshal(out, &e)
	return e.Code, out
}

// mkToken creates an admin token with the bootstrap token and returns it.
func (b *bundle) mkToken(scope adminv1.Scope, role adminv1.Role, orgID, teamID string) string {
	b.t.Helper()
	resp, err := b.root().Token.CreateAdminToken(context.Background(), connect.NewRequest(&adminv1.CreateAdminTokenRequest{
		Name: "test " + scope.String() + " " + role.String(), Scope: scope, Role: role, OrgId: orgID, TeamId: teamID,
	}))
	require.NoError(b.t, err)
	return resp.Msg.Token
}

// mkOrg creates an org with the bootstrap token.
func (b *bundle) mkOrg(name string) *adminv1.Org {
	b.t.Helper()
	resp, err := b.root().Org.CreateOrg(context.Background(), connect.NewRequest(&adminv1.CreateOrgRequest{Name: name}))
	require.NoError(b.t, err)
	return resp.Msg.Org
}

// codeOf returns the Connect code of err ("ok" for nil).
func codeOf(err error) string {
	if err == nil {
		return "ok"
	}
	return connect.CodeOf(err).String()
}

// auditCount returns how many audit rows exist.
func (b *bundle) auditCount() int64 {
	b.t.Helper()
	var n int64
	require.NoError(b.t, b.pool.QueryRow(context.Background(), `SELECT count(*) FROM audit_log`).Scan(&n))
	return n
}
