package admin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/nats-io/nats.go"

	"github.com/sluicegw/sluice/controlplane/internal/authz"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// explainService implements ExplainService (docs/explain.md): the control
// plane holds no data-plane code, so it forwards the query to a live data
// plane of the region (wire.ExplainSubject, request/reply in a queue
// group), which runs its own pipeline in dry run against its live
// catalog and Redis. The caller's tenant scope travels with the query;
// the data plane answers a credential outside it as not found.
type explainService struct{ *Server }

// explainWait bounds the wait for a data plane's answer.
const explainWait = 8 * time.Second

// Explain bounds.
const (
	maxExplainHeaders     = 64
	maxExplainHeaderValue = 8 << 10
	maxExplainTokenLen    = 16 << 10
	maxExplainPromptBytes = 64 << 20
	maxExplainCount       = 1_000_000_000
	// maxExplainBodyBytes keeps a query within one NATS message (1 MiB
	// by default); larger requests are described by their shape.
	maxExplainBodyBytes = 512 << 10
)

// explainRoutes are the proxy routes a query may name ("" is chat).
var explainRoutes = map[string]bool{"": true, "/v1/chat/completions": true, "/v1/completions": true,
	"/v1/embeddings": true, "/v1/messages": true, "/v1/responses": true}

func validateExplain(req *adminv1.ExplainRequest) error {
	c := &validator{}
	if r := req.GetRegion(); r != "" && !wire.ValidRegion(r) {
		c.add("region", "not a valid region name")
	}
	q := req.GetQuery()
	if q == nil {
		c.add("query", "required: the request to explain")
		return c.err()
	}
	n := 0
	for _, set := range []bool{q.GetKeyId() != "", q.GetToken() != "", q.GetJwt() != nil} {
		if set {
			n++
		}
	}
	if n != 1 {
		c.add("query", "exactly one of key_id, token and jwt is required")
	}
	if len(q.GetToken()) > maxExplainTokenLen {
		c.add("query.token", "longer than %d bytes", maxExplainTokenLen)
	}
	if j := q.GetJwt(); j != nil && j.GetIssuer() == "" {
		c.add("query.jwt.issuer", "required: the issuer (iss) the claims are from")
	}
	if !explainRoutes[q.GetRoute()] {
		c.add("query.route", "unknown route %q: one of /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/messages, /v1/responses", q.GetRoute())
	}
	if len(q.GetHeaders()) > maxExplainHeaders {
		c.add("query.headers", "at most %d headers", maxExplainHeaders)
	}
	for name, v := range q.GetHeaders() {
		f := "query.headers[" + name + "]"
		switch {
		case !headerNamePattern.MatchString(name):
			c.add(f, "not a valid header name")
		case credentialHeaders[strings.ToLower(name)]:
			c.add(f, "carries a credential: give the key as key_id or token")
		case len(v) > maxExplainHeaderValue:
			c.add(f, "value longer than %d bytes", maxExplainHeaderValue)
		}
	}
	shape := q.GetModel() != "" || q.GetStream() || q.GetMaxTokens() != 0 || q.GetN() != 0 || q.GetTools() || q.GetPromptBytes() != 0
	switch {
	case len(q.GetBody()) > 0 && shape:
		c.add("query.body", "body and the shape fields (model, stream, max_tokens, n, tools, prompt_bytes) are exclusive")
	case len(q.GetBody()) > maxExplainBodyBytes:
		c.add("query.body", "at most %d bytes: describe a larger request by its shape (model, prompt_bytes, ...)", maxExplainBodyBytes)
	case len(q.GetBody()) == 0 && q.GetModel() == "":
		c.add("query.model", "required (or a whole body)")
	}
	for _, f := range []struct {
		name string
		v    int64
		max  int64
	}{{"query.max_tokens", q.GetMaxTokens(), maxExplainCount}, {"query.n", q.GetN(), maxExplainCount}, {"query.prompt_bytes", q.GetPromptBytes(), maxExplainPromptBytes}} {
		if f.v < 0 || f.v > f.max {
			c.add(f.name, "must be between 0 and %d", f.max)
		}
	}
	return c.err()
}

// Explain implements ExplainService.Explain.
func (s *explainService) Explain(ctx context.Context, req *connect.Request[adminv1.ExplainRequest]) (*connect.Response[adminv1.ExplainResponse], error) {
	p := authz.FromContext(ctx)
	// Every role may explain; what it may see is its scope, enforced by
	// the data plane on the credential the query names.
	authz.MarkChecked(ctx)
	if p == nil {
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("no principal"))
	}
	if err := validateExplain(req.Msg); err != nil {
		return nil, err
	}
	if id := req.Msg.GetQuery().GetKeyId(); id != "" {
		// Checked here too (the data plane checks every credential): a key
		// outside the caller's scope is not found without asking anyone.
		k, err := s.store.KeyGet(ctx, tenant(ctx), id)
		if err != nil {
			return nil, err
		}
		if err := authz.Check(ctx, p, authz.Read, keyTarget(k)); err != nil {
			return nil, err
		}
	}
	region, err := s.explainRegion(ctx, req.Msg.GetRegion())
	if err != nil {
		return nil, err
	}
	if s.nc == nil {
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("this control plane has no NATS connection to reach data planes"))
	}
	f := authz.FilterFor(p)
	data, err := wire.Marshal(&configv1.ExplainWireRequest{ScopeOrgId: f.OrgID, ScopeTeamId: f.TeamID, Query: req.Msg.GetQuery()})
	if err != nil {
		return nil, fmt.Errorf("encode explain request: %w", err)
	}
	wctx, cancel := context.WithTimeout(ctx, explainWait)
	defer cancel()
	msg, err := s.nc.RequestWithContext(wctx, wire.ExplainSubject(region), data)
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("no data plane of region %s is connected to answer explain requests", region))
	case ctx.Err() == nil && (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout)):
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("no data plane of region %s answered within %s", region, explainWait))
	case err != nil:
		return nil, fmt.Errorf("explain request: %w", err)
	}
	rep := &configv1.ExplainWireReply{}
	if err := wire.Unmarshal(msg.Data, rep); err != nil {
		return nil, fmt.Errorf("decode explain reply: %w", err)
	}
	switch rep.GetError() {
	case "":
	case "not_found":
		return nil, connect.NewError(connect.CodeNotFound, errors.New("no such key, token or trusted issuer in this token's scope"))
	case "invalid_argument":
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New(rep.GetDetail()))
	case "unavailable":
		return nil, connect.NewError(connect.CodeUnavailable, errors.New(rep.GetDetail()))
	default:
		return nil, fmt.Errorf("data plane explain error %q: %s", rep.GetError(), rep.GetDetail())
	}
	return connect.NewResponse(&adminv1.ExplainResponse{Trace: rep.GetTrace()}), nil
}

// explainRegion is name, or the only region when name is empty.
func (s *explainService) explainRegion(ctx context.Context, name string) (string, error) {
	if name != "" {
		return name, nil
	}
	regions, err := s.store.RegionList(ctx)
	if err != nil {
		return "", err
	}
	if len(regions) == 1 {
		return regions[0].Name, nil
	}
	names := make([]string, len(regions))
	for i, r := range regions {
		names[i] = r.Name
	}
	return "", invalid("region", "required when there is not exactly one region (regions: %s)", strings.Join(names, ", "))
}
