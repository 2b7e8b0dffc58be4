#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
int main(int argc,char**argv){
  size_t n = 64ull<<20; // floats = 256MB
  float* a = aligned_alloc(64, n*4);
  #pragma omp parallel for
  for(size_t i=0;i<n;i++) a[i]=1.0f;
  double best=1e9; float tot=0;
  for(int r=0;r<5;r++){
    double t0=omp_get_wtime();
    float s=0;
    #pragma omp parallel for reduction(+:s)
    for(size_t i=0;i<n;i+=32){
      __m256 x=_mm256_add_ps(_mm256_add_ps(_mm256_load_ps(a+i),_mm256_load_ps(a+i+8)),_mm256_add_ps(_mm256_load_ps(a+i+16),_mm256_load_ps(a+i+24)));
      float o[8]; _mm256_storeu_ps(o,x); s+=o[0];
    }
    double t=omp_get_wtime()-t0; if(t<best)best=t; tot+=s;
  }
  printf("threads %d: %.1f GB/s %f\n", omp_get_max_threads(), n*4/best/1e9, tot);
}
