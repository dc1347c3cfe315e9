package gateway

// protocols.go serves the agents' wire protocols through the pipeline of
// chat completions (docs/protocols.md): Anthropic Messages (POST
// /v1/messages) and OpenAI Responses (POST /v1/responses, GET
// /v1/responses/{id}, POST /v1/responses/{id}/cancel). A protocol changes
// only the edges of an exchange: how the key is presented, how the body
// is read, which deployments may serve it (capabilities.protocols) and the
// shape of its errors; keys, permissions, aliases, limits, budgets,
// routing and the ledger are those of every route.

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/anthropic"
	"github.com/sluicegw/sluice/dataplane/internal/authn"
	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/respstore"
	"github.com/sluicegw/sluice/dataplane/internal/routing"
)

// Routes of the other protocols.
const (
	RouteMessages  = anthropic.RouteMessages
	RouteResponses = openai.RouteResponses
)

// ResponseStore remembers which deployment produced each Response
// (respstore.Store).
type ResponseStore interface {
	Put(ctx context.Context, id string, e respstore.Entry) error
	Get(ctx context.Context, id string) (e respstore.Entry, found bool, err error)
}

// protocol is the wire protocol of a route.
type protocol struct {
	// name is the capabilities.protocols value a deployment must declare
	// ("": every deployment serves it).
	name       string
	parse      func([]byte) (*openai.Request, *openai.Error)
	writeError func(http.ResponseWriter, *openai.Error)
	// apiKey: the key may come in x-api-key as well as a bearer token.
	apiKey bool
	// wrap wraps the route's ResponseWriter (nil: none).
	wrapper func(http.ResponseWriter) http.ResponseWriter
}

var (
	openAIProtocol    = protocol{parse: openai.ParseRequest, writeError: openai.WriteError}
	anthropicProtocol = protocol{name: anthropic.Protocol, parse: anthropic.ParseMessages, writeError: anthropic.WriteError, apiKey: true,
		wrapper: func(w http.ResponseWriter) http.ResponseWriter { return &anthropic.Writer{ResponseWriter: w} }}
	responsesProtocol = protocol{name: openai.ProtocolResponses, parse: openai.ParseResponses, writeError: openai.WriteError}
)

func (p *protocol) wrap(w http.ResponseWriter) http.ResponseWriter {
	if p.wrapper == nil {
		return w
	}
	return p.wrapper(w)
}

// authenticate runs the handler's Authenticator, or for a protocol whose
// clients send x-api-key the same virtual keys read from either header.
func (p *protocol) authenticate(h *Handler, cat *catalog.Catalog, r *http.Request) (*catalog.Principal, *openai.Error) {
	if p.apiKey {
		return authn.APIKeyOrBearer{VirtualKeys: authn.VirtualKeys{Peppers: h.cfg.Peppers}}.Authenticate(cat, r, time.Now())
	}
	return h.authenticate(cat, r)
}

// registerProtocols mounts the routes of the other protocols.
func (h *Handler) registerProtocols(mux *http.ServeMux) {
	mux.Handle("POST "+RouteMessages, h.serve(RouteMessages, &anthropicProtocol))
	mux.HandleFunc(anthropic.RouteCountTokens, func(w http.ResponseWriter, r *http.Request) {
		ensureRequestID(w)
		CloseUnreadBody(w, r)
		anthropic.WriteError(w, &openai.Error{Status: http.StatusNotFound, Type: openai.TypeNotFound, Code: openai.CodeUnknownRoute, NoRetry: true,
			Message: "count_tokens is not served by this gateway"})
	})
	mux.HandleFunc(RouteMessages, func(w http.ResponseWriter, r *http.Request) {
		ensureRequestID(w)
		CloseUnreadBody(w, r)
		anthropic.WriteError(w, &openai.Error{Status: http.StatusMethodNotAllowed, Type: openai.TypeInvalidRequest, Code: openai.CodeMethodNotAllowed,
			Message: fmt.Sprintf("%s does not accept %s", r.URL.Path, r.Method), NoRetry: true})
	})
	mux.Handle("POST "+RouteResponses, h.serve(RouteResponses, &responsesProtocol))
	mux.HandleFunc("GET "+RouteResponses+"/{id}", h.responseOp(false))
	mux.HandleFunc("POST "+RouteResponses+"/{id}/cancel", h.responseOp(true))
}

// protocolDeployments keeps the deployments of group declaring the
// route's protocol; none is a 400 protocol_not_served naming the group.
func (x *exchange) protocolDeployments(group string, deps []*catalog.Deployment) ([]*catalog.Deployment, *openai.Error) {
	name := x.proto.name
	if name == "" {
		return deps, nil
	}
	serves := func(d *catalog.Deployment) bool { return slices.Contains(d.GetCapabilities().GetProtocols(), name) }
	if !slices.ContainsFunc(deps, func(d *catalog.Deployment) bool { return !serves(d) }) {
		return deps, nil // all serve it (the usual case): no copy
	}
	var keep []*catalog.Deployment
	for _, d := range deps {
		if serves(d) {
			keep = append(keep, d)
		}
	}
	if len(keep) == 0 {
		return nil, openai.InvalidRequest(openai.CodeProtocolNotServed, "model",
			fmt.Sprintf("no deployment of model %q serves %s (the deployment must declare the protocol %q)", group, x.route, name))
	}
	return keep, nil
}

// pinPrevious keeps, for a Responses request naming previous_response_id,
// only the deployment that produced that Response (engines store them
// per engine): after every filter, so a follow-up the key may no longer
// send there is refused rather than sent elsewhere. A record that is
// missing or was made by another key is previous_response_not_found; a
// deployment that is gone or now filtered out is
// previous_response_unavailable (400), one that is only unhealthy or
// ejected right now a retryable 503.
func (x *exchange) pinPrevious(ctx context.Context, cat *catalog.Catalog, cands []candidate) ([]candidate, *openai.Error) {
	if x.route != RouteResponses {
		return cands, nil
	}
	prev := openai.PreviousResponseID(x.req)
	if prev == "" {
		return cands, nil
	}
	ent, e := x.h.lookupResponse(ctx, prev, x.p)
	if e != nil {
		if e.Code == openai.CodeResponseNotFound {
			e = openai.InvalidRequest(openai.CodePreviousResponseNotFound, "previous_response_id",
				fmt.Sprintf("previous response with id %q not found", prev))
		}
		return nil, e
	}
	x.pinned = ent.Deployment
	if ent.ModelGroup != x.group {
		return nil, openai.InvalidRequest(openai.CodePreviousResponseUnavailable, "previous_response_id",
			fmt.Sprintf("previous response %q was produced by model %q, not %q", prev, ent.ModelGroup, x.group))
	}
	for _, c := range cands {
		if c.d.GetId() == ent.Deployment {
			return []candidate{c}, nil
		}
	}
	if cat.HasDeployment(ent.Deployment) && slices.ContainsFunc(cat.Deployments(x.group), func(d *catalog.Deployment) bool { return d.GetId() == ent.Deployment }) {
		return nil, openai.Unavailable(openai.CodePreviousResponseUnavailable,
			fmt.Sprintf("the deployment holding previous response %q is unavailable right now or may not serve this request", prev), 5*time.Second)
	}
	return nil, openai.InvalidRequest(openai.CodePreviousResponseUnavailable, "previous_response_id",
		fmt.Sprintf("the deployment that produced previous response %q no longer exists; start a new conversation", prev))
}

// lookupResponse returns the record of a Response the principal's key
// created (response_not_found otherwise).
func (h *Handler) lookupResponse(ctx context.Context, id string, p *catalog.Principal) (respstore.Entry, *openai.Error) {
	if h.cfg.Responses == nil {
		return respstore.Entry{}, openai.Unavailable(openai.CodeResponseStoreUnavailable, "this gateway keeps no record of Responses", 5*time.Second)
	}
	ent, found, err := h.cfg.Responses.Get(ctx, id)
	if err != nil {
		h.log.Warn("responses table unavailable", "error", err)
		return respstore.Entry{}, openai.Unavailable(openai.CodeResponseStoreUnavailable, "the record of Responses cannot be read right now; retry shortly", time.Second)
	}
	if !found || ent.KeyID != p.Key.GetId() {
		return respstore.Entry{}, &openai.Error{Status: http.StatusNotFound, Type: openai.TypeNotFound, Code: openai.CodeResponseNotFound, NoRetry: true,
			Message: fmt.Sprintf("no response with id %q", id)}
	}
	return ent, nil
}

// ResponseID records the id of the Response the exchange's deployment
// produced (forward.ResponseRecorder), before the client sees it.
func (x *exchange) ResponseID(id string) {
	x.responseID = id
	if x.h.cfg.Responses == nil || x.dep == nil || x.p == nil {
		return
	}
	err := x.h.cfg.Responses.Put(context.Background(), id, respstore.Entry{Deployment: x.dep.GetId(), ModelGroup: x.group, KeyID: x.p.Key.GetId()})
	if err != nil {
		x.h.m.responseRecordErrors.Inc()
		x.h.log.Warn("response not recorded: follow-ups naming it will be refused", "request_id", x.id, "deployment", x.dep.GetId(), "error", err)
	}
}

// responseOp serves GET /v1/responses/{id} (cancel false) and POST
// /v1/responses/{id}/cancel: on the deployment that produced the
// Response, for the key that created it. They are not inference: no
// limits are taken and no usage event is written.
func (h *Handler) responseOp(cancel bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ensureRequestID(w)
		CloseUnreadBody(w, r)
		cat, p, e := h.Authenticate(r)
		if e == nil {
			e = h.responseOpRun(w, r, cat, p, cancel)
		}
		if e != nil {
			openai.WriteError(w, e)
		}
	}
}

func (h *Handler) responseOpRun(w http.ResponseWriter, r *http.Request, cat *catalog.Catalog, p *catalog.Principal, cancel bool) *openai.Error {
	if routes := p.Key.GetAllowedRoutes(); len(routes) > 0 && !slices.Contains(routes, RouteResponses) {
		return openai.Forbidden(openai.CodeRouteNotAllowed, "", "this key may not call "+RouteResponses)
	}
	if r.URL.RawQuery != "" {
		return openai.InvalidRequest(openai.CodeUnsupportedParameter, "", "query parameters (stream, starting_after, include) are not supported on this route")
	}
	id := r.PathValue("id")
	ent, e := h.lookupResponse(r.Context(), id, p)
	if e != nil {
		return e
	}
	allowed, _ := routing.AllowedDeployments(p, nil, ent.ModelGroup, cat.Deployments(ent.ModelGroup))
	i := slices.IndexFunc(allowed, func(d *catalog.Deployment) bool { return d.GetId() == ent.Deployment })
	if i < 0 {
		return &openai.Error{Status: http.StatusNotFound, Type: openai.TypeNotFound, Code: openai.CodePreviousResponseUnavailable, NoRetry: true,
			Message: fmt.Sprintf("the deployment that produced response %q is gone or this key may no longer use it", id)}
	}
	d := allowed[i]
	if d.CredentialErr != nil {
		h.reportCredentialError(d)
		return openai.Unavailable(openai.CodeNoHealthyDeployment, "the deployment holding this response is unavailable right now", 5*time.Second)
	}
	u := strings.TrimSuffix(d.GetApiBase(), "/") + "/responses/" + url.PathEscape(id)
	method := http.MethodGet
	if cancel {
		u, method = u+"/cancel", http.MethodPost
	}
	ctx, stop := context.WithTimeout(r.Context(), min(h.cfg.RequestTimeout, time.Minute))
	defer stop()
	ureq, err := http.NewRequestWithContext(ctx, method, u, nil)
	if err != nil {
		return openai.Upstream(openai.CodeUpstreamError, "the deployment's upstream address is invalid")
	}
	ureq.Header.Set("X-Request-Id", w.Header().Get(openai.RequestIDHeader))
	if d.Credential != "" {
		ureq.Header.Set("Authorization", "Bearer "+d.Credential)
	}
	resp, err := h.fwd.Client.Do(ureq)
	if err != nil {
		if r.Context().Err() != nil {
			return nil
		}
		return openai.Upstream(openai.CodeUpstreamError, "the upstream model server could not be reached")
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return openai.Upstream(openai.CodeUpstreamError, "the upstream model server broke off its answer")
	}
	if resp.StatusCode >= 500 {
		return openai.Upstream(openai.CodeUpstreamError, fmt.Sprintf("the upstream model server failed (HTTP %d)", resp.StatusCode))
	}
	if ct := resp.Header.Get("Content-Type"); ct != "" {
		w.Header().Set("Content-Type", ct)
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(b)
	return nil
}
