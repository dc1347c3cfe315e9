package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"connectrpc.com/connect"

	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// httpTimeout bounds every admin API call.
const httpTimeout = 30 * time.Second

// clients are the admin API clients of one server and token.
type clients struct {
	server    string
	orgs      adminv1connect.OrgServiceClient
	teams     adminv1connect.TeamServiceClient
	users     adminv1connect.UserServiceClient
	keys      adminv1connect.KeyServiceClient
	customers adminv1connect.CustomerServiceClient
	// labelScopes manages project and tag scopes.
	labelScopes adminv1connect.LabelScopeServiceClient
	issuers     adminv1connect.IssuerServiceClient
	tokens      adminv1connect.AdminTokenServiceClient
	audit       adminv1connect.AuditServiceClient
	fleet       adminv1connect.FleetServiceClient
	rollout     adminv1connect.RolloutServiceClient
	spend       adminv1connect.SpendServiceClient
	alerts      adminv1connect.AlertServiceClient
	models      adminv1connect.ModelServiceClient
	traffic     adminv1connect.TrafficServiceClient
	explain     adminv1connect.ExplainServiceClient
}

// newClients builds the Connect clients; every request carries
// "Authorization: Bearer <token>".
func newClients(server, token string) *clients {
	hc := &http.Client{Timeout: httpTimeout}
	auth := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			req.Header().Set("Authorization", "Bearer "+token)
			return next(ctx, req)
		}
	})
	opts := connect.WithInterceptors(auth)
	return &clients{
		server:      server,
		orgs:        adminv1connect.NewOrgServiceClient(hc, server, opts),
		teams:       adminv1connect.NewTeamServiceClient(hc, server, opts),
		users:       adminv1connect.NewUserServiceClient(hc, server, opts),
		keys:        adminv1connect.NewKeyServiceClient(hc, server, opts),
		customers:   adminv1connect.NewCustomerServiceClient(hc, server, opts),
		labelScopes: adminv1connect.NewLabelScopeServiceClient(hc, server, opts),
		issuers:     adminv1connect.NewIssuerServiceClient(hc, server, opts),
		tokens:      adminv1connect.NewAdminTokenServiceClient(hc, server, opts),
		audit:       adminv1connect.NewAuditServiceClient(hc, server, opts),
		fleet:       adminv1connect.NewFleetServiceClient(hc, server, opts),
		rollout:     adminv1connect.NewRolloutServiceClient(hc, server, opts),
		spend:       adminv1connect.NewSpendServiceClient(hc, server, opts),
		alerts:      adminv1connect.NewAlertServiceClient(hc, server, opts),
		models:      adminv1connect.NewModelServiceClient(hc, server, opts),
		traffic:     adminv1connect.NewTrafficServiceClient(hc, server, opts),
		explain:     adminv1connect.NewExplainServiceClient(hc, server, opts),
	}
}

// target is the server and token a command uses and where they came from.
type target struct {
	server, token string
	context       string // context name, "" when only the environment was used
}

// resolve picks the server and token: the context named by --context (or
// $SLUICE_CONTEXT, or the config's current context), with $SLUICE_SERVER
// and $SLUICE_TOKEN overriding its fields.
func (a *app) resolve() (target, error) {
	var t target
	path, err := configPath(a.getenv)
	if err != nil {
		return t, err
	}
	cfg, err := a.loadConfig(path)
	if err != nil {
		return t, err
	}
	name := a.contextName
	if name == "" {
		name = cfg.CurrentContext
	}
	if name != "" {
		c := cfg.find(name)
		switch {
		case c != nil:
			t = target{server: c.Server, token: c.Token, context: c.Name}
		case a.contextName != "":
			return t, fmt.Errorf("context %q is not in %s (contexts: %s)", name, path, cfg.names())
		}
	}
	if s := a.getenv("SLUICE_SERVER"); s != "" {
		t.server = s
	}
	if tok := a.getenv("SLUICE_TOKEN"); tok != "" {
		t.token = tok
	}
	if t.server == "" || t.token == "" {
		return t, errors.New("not logged in: run 'sluicectl login --server URL --token TOKEN', or set SLUICE_SERVER and SLUICE_TOKEN")
	}
	if t.server, err = normalizeServer(t.server); err != nil {
		return t, err
	}
	return t, nil
}

// apiError is an admin API error as the user sees it: the Connect code and
// the server's message.
type apiError struct {
	err *connect.Error
}

func (e *apiError) Error() string {
	msg := fmt.Sprintf("%s: %s", e.err.Code(), e.err.Message())
	switch e.err.Code() {
	case connect.CodeUnauthenticated:
		msg += " (log in again with 'sluicectl login', or check SLUICE_TOKEN)"
	case connect.CodeUnimplemented:
		msg += " (the server does not offer this call: is it older than sluicectl?)"
	}
	return msg
}

func (e *apiError) Unwrap() error { return e.err }

// apiErr wraps Connect errors as apiError; other errors pass unchanged.
func apiErr(err error) error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return &apiError{ce}
	}
	return err
}

// call runs one admin API call and returns its message, with Connect
// errors turned into apiError.
func call[Req, Res any](ctx context.Context, f func(context.Context, *connect.Request[Req]) (*connect.Response[Res], error), req *Req) (*Res, error) {
	resp, err := f(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, apiErr(err)
	}
	return resp.Msg, nil
}
