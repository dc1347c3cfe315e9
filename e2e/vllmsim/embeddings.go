package vllmsim

import (
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"time"
)

type embeddingRequest struct {
	Model          string          `json:"model"`
	Input          json.RawMessage `json:"input"`
	EncodingFormat string          `json:"encoding_format"`
	Dimensions     *int            `json:"dimensions"`
	Priority       *int            `json:"priority"`
}

// Embedding returns the simulator's embedding of a tokenized input: a unit
// vector of dim float32s drawn from a generator seeded by the tokens, so
// equal inputs get equal vectors and different inputs unrelated ones.
func Embedding(tokens []TokenID, dim int) []float32 {
	h := cacheSaltSeed("embedding")
	for _, t := range tokens {
		h = mix64(h ^ uint64(t))
	}
	rng := rand.New(rand.NewPCG(h, h^0x85ebca6b))
	v := make([]float32, dim)
	var norm float64
	for i := range v {
		x := rng.NormFloat64()
		v[i] = float32(x)
		norm += x * x
	}
	scale := float32(1 / math.Sqrt(norm))
	for i := range v {
		v[i] *= scale
	}
	return v
}

// truncateNormalize keeps the first dim values and rescales them to unit
// length, as matryoshka embeddings do for a smaller dimensions.
func truncateNormalize(v []float32, dim int) []float32 {
	v = v[:dim]
	var norm float64
	for _, x := range v {
		norm += float64(x) * float64(x)
	}
	if norm == 0 {
		return v
	}
	scale := float32(1 / math.Sqrt(norm))
	for i := range v {
		v[i] *= scale
	}
	return v
}

// handleEmbeddings serves /v1/embeddings. Every input is a prefill-only
// sequence: it takes a running slot and prefill time like a real pooling
// request, and finishes when its prompt is computed.
func (s *Server) handleEmbeddings(w http.ResponseWriter, r *http.Request) {
	var req embeddingRequest
	if err := decodeBody(w, r, &req); err != nil {
		writeAPIError(w, err)
		return
	}
	if err := s.checkModel(req.Model); err != nil {
		writeAPIError(w, err)
		return
	}
	if req.EncodingFormat != "" && req.EncodingFormat != "float" && req.EncodingFormat != "base64" {
		writeAPIError(w, &apiError{status: 400, typ: "BadRequestError", param: "encoding_format",
			message: fmt.Sprintf("encoding_format must be \"float\" or \"base64\", got %q", req.EncodingFormat)})
		return
	}
	dim := s.cfg.EmbeddingDim
	if req.Dimensions != nil {
		if *req.Dimensions < 1 || *req.Dimensions > dim {
			writeAPIError(w, &apiError{status: 400, typ: "BadRequestError", param: "dimensions",
				message: fmt.Sprintf("dimensions must be between 1 and %d, got %d", dim, *req.Dimensions)})
			return
		}
		dim = *req.Dimensions
	}
	prompts, aerr := parsePrompts(req.Input, "input")
	if aerr != nil {
		writeAPIError(w, aerr)
		return
	}
	priority, aerr := s.priorityOf(r, req.Priority)
	if aerr != nil {
		writeAPIError(w, aerr)
		return
	}
	ordinal := s.ordinal.Add(1)
	id := s.requestID(r, "embd-", ordinal)
	specs := make([]SequenceSpec, len(prompts))
	lens := make([]int, len(prompts))
	total := 0
	for i, p := range prompts {
		if len(p) == 0 {
			writeAPIError(w, badRequest("input %d is empty", i))
			return
		}
		if len(p) > s.cfg.MaxModelLen {
			writeAPIError(w, badRequest("This model's maximum context length is %d tokens. However, your request has %d input tokens. Please reduce the length of the input.",
				s.cfg.MaxModelLen, len(p)))
			return
		}
		specs[i] = SequenceSpec{ID: fmt.Sprintf("%s-%d", id, i), Prompt: p, Priority: priority}
		lens[i] = len(p)
		total += len(p)
	}
	j := newJob(false, lens)
	if !s.submit(w, j, specs) {
		return
	}
	defer s.eng.abort(j)
	for {
		select {
		case <-r.Context().Done():
			return
		case <-j.notify:
		}
		done, err := j.state()
		if err != nil {
			writeAPIError(w, &apiError{status: 500, typ: "InternalServerError", message: err.Error()})
			return
		}
		if done {
			break
		}
	}
	type item struct {
		Object    string `json:"object"`
		Index     int    `json:"index"`
		Embedding any    `json:"embedding"`
	}
	data := make([]item, len(prompts))
	for i, p := range prompts {
		v := truncateNormalize(Embedding(p, s.cfg.EmbeddingDim), dim)
		var emb any = v
		if req.EncodingFormat == "base64" {
			buf := make([]byte, 4*len(v))
			for k, x := range v {
				binary.LittleEndian.PutUint32(buf[4*k:], math.Float32bits(x))
			}
			emb = base64.StdEncoding.EncodeToString(buf)
		}
		data[i] = item{Object: "embedding", Index: i, Embedding: emb}
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"id": id, "object": "list", "created": time.Now().Unix(), "model": s.names[0], "data": data,
		"usage": map[string]int{"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
	})
}
